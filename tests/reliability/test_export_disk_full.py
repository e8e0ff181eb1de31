"""``python -m gradnorm.export`` onto a full disk: one ``error:`` line, exit code 1 (a failed write, as
for the trainer), nothing half-written; safetensors' own error (``SafetensorError``, no OSError) included.

The disk is a small tmpfs mounted here (tests/reliability/test_disk_full.py's ``small_disk``, which
needs root). The export's one write (``write_pretrained`` of a tiny random Llama) stands in for the
checkpoint's weights, so no Hugging Face model has to be downloaded; the control is the same export
onto a disk with room.
"""

import pytest
from tests.helpers.trainer import one_error_line

from gradnorm import export


@pytest.fixture
def tiny_export(monkeypatch):
    """``export.main``'s conversion replaced by the write of a tiny Llama of its own width into ``--out``."""
    transformers = pytest.importorskip("transformers")
    import torch

    import tiny_models  # examples/tiny_models.py (tests/conftest.py puts it on the path)

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    tokenizer = tiny_models.build_tiny_tokenizer()

    def convert(run_dir, out_dir, step=None):
        return export.write_pretrained(config, dict(weights), tokenizer, out_dir)

    monkeypatch.setattr(export, "export_checkpoint", convert)


@pytest.mark.launch
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disk, tiny_export, tmp_path, capsys):
    disk = small_disk(64 << 10)  # room for the directory and the marker, not for the weights
    assert export.main([str(tmp_path / "run"), "--out", str(disk / "hf")]) == 1
    err = capsys.readouterr().err
    one_error_line(err, f"could not export to {disk / 'hf'}")
    assert "no space left on device" in err.lower()
    assert sorted(p.name for p in disk.iterdir()) == []  # the temporary directory is gone, no half export


def test_control_the_same_export_with_room_succeeds(tiny_export, tmp_path, capsys):
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert capsys.readouterr().out.startswith(f"saved {tmp_path / 'hf'}")
