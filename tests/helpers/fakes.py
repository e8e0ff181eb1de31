"""Files on disk that look like a model or a checkpoint to the trainer's preflight, and are not."""

import json
from pathlib import Path


def fake_model(path: Path, truncate: bool = False) -> None:
    """A save_pretrained-shaped directory: config.json and a one-tensor model.safetensors."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "vocab_size": 16}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = len(header).to_bytes(8, "little") + header + bytes(8)
    (path / "model.safetensors").write_bytes(data[:-3] if truncate else data)


def fake_checkpoint(run: Path, name: str) -> None:
    """``run/name``: with the name ``ckpt_step{N}``, a directory that ``checkpointing.latest_checkpoint``
    takes for a complete checkpoint (the name is the mark: only the last act of a save gives it);
    ``.ckpt_step{N}.tmp`` is what a save killed mid-write leaves. Its files are not a checkpoint, so
    a preflight that read them, instead of refusing on the flags first, would say something else."""
    path = run / name
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"never read by the preflight")
    (path / "trainer_state.json").write_text('{"step": "never read by the preflight"}')
