"""The JSONL prompt task: one-line errors for bad files, the exact-match reward, left padding.

The file and the reward are plain Python; the task itself needs a tokenizer, for which the tiny
character-level one of ``gradnorm.models.hf`` stands in (built locally, no download).
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from gradnorm.tasks.prompts import PromptTask, load_prompts
from gradnorm.tasks.rewards import exact_match_math, extract_answer, get_reward

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "arithmetic.jsonl"


def write(tmp_path, text):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ the file


def test_the_example_file_loads():
    examples = load_prompts(EXAMPLES)
    assert 40 <= len(examples) <= 60
    assert all(ex.prompt and ex.answer for ex in examples)


def test_answers_may_be_numbers_and_blank_lines_are_skipped(tmp_path):
    examples = load_prompts(write(tmp_path, '{"prompt": "1+1?", "answer": 2}\n\n{"prompt": "x", "answer": "-3"}\n'))
    assert [ex.answer for ex in examples] == ["2", "-3"]
    assert load_prompts(write(tmp_path, '{"prompt": "x", "answer": 1e300}\n'))[0].answer == "1e+300"  # finite: kept


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", answer: 2}\n', r"p\.jsonl:2: not valid JSON"),
    ('{"prompt": "a"}\n', r"p\.jsonl:1: missing field 'answer'"),
    ('{"answer": "1"}\n', r"p\.jsonl:1: missing field 'prompt'"),
    ('["a", "1"]\n', r"p\.jsonl:1: expected a JSON object"),
    ('{"prompt": "", "answer": "1"}\n', r"p\.jsonl:1: \"prompt\" must be a non-empty string"),
    ('{"prompt": "a", "answer": null}\n', r"p\.jsonl:1: \"answer\" must be a string or a number"),
    ('{"prompt": "a", "answer": NaN}\n', r"p\.jsonl:1: \"answer\" is nan, which no response can match"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": -Infinity}\n', r"p\.jsonl:2: \"answer\" is -inf"),
    ('\n\n', r"holds no prompts"),
    ('{"prompt": "a", "answer": ' + "[" * 100000 + "]" * 100000 + "}\n", r"p\.jsonl:1: nested too deeply to read"),
    ('{"prompt": "a", "answer": ' + "9" * 5001 + "}\n", r"p\.jsonl:1: a number with more digits than Python converts"),
])
def test_bad_files_give_one_line_errors(tmp_path, text, message):
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_a_directory_or_a_fifo_is_not_called_missing(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for path, says in ((tmp_path, "is a directory"), (tmp_path / "fifo", "is not a regular file")):
        with pytest.raises(ValueError, match=says):
            load_prompts(path)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompts file .*nope.jsonl does not exist"):
        load_prompts(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------ the reward


@pytest.mark.parametrize("response, answer, reward", [
    ("12 + 13 = 25", "25", 1.0),
    ("The answer is 25.", "25", 1.0),
    ("25 or maybe 26", "25", 0.0),  # the LAST number counts
    (r"so \boxed{-7} and not 3", "-7", 1.0),  # a boxed value beats a later number
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),  # nested braces, compared as text
    ("it is 1,234", "1234", 1.0),  # thousands separators
    ("3.0", "3", 1.0),  # exact rationals: 3.0 == 3
    ("0.5", "1/2", 1.0),
    ("0.30000001", "0.3", 0.0),  # no float tolerance
    ("no digits here", "3", 0.0),
    ("", "3", 0.0),
    (r"\boxed{4", "4", 1.0),  # an unclosed box is no box: the last number counts
])
def test_exact_match_math(response, answer, reward):
    assert exact_match_math(response, answer) == reward


def test_extract_answer_prefers_the_last_box():
    assert extract_answer(r"\boxed{1} then \boxed{2} and 3") == "2"


def test_rewards_are_pluggable_by_name_or_import_path(monkeypatch):
    assert get_reward("exact_match_math") is exact_match_math
    module = type(sys)("my_rewards")
    module.always_one = lambda response, answer: 1.0
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    assert get_reward("my_rewards:always_one")("x", "y") == 1.0
    with pytest.raises(ValueError, match="unknown reward 'nope': expected one of exact_match_math"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot import it"):
        get_reward("my_rewards:missing")


# ------------------------------------------------------------------ the task (needs a tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_prompts_are_left_padded_to_the_longest_one(tokenizer, tmp_path):
    path = write(tmp_path, json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n"
                 + json.dumps({"prompt": "What is 10 + 20?", "answer": "30"}) + "\n")
    task = PromptTask.from_file(path, tokenizer, max_new_tokens=8)
    pad = task.tokenizer.pad_id
    short = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True)
    short_ids = tokenizer(short, add_special_tokens=False)["input_ids"]
    assert task.prompt_len == len(short_ids) + len("What is 10 + 20?") - len("1+1?")
    assert task.prompt_ids[0, -len(short_ids):].tolist() == short_ids
    assert (task.prompt_ids[0, : task.prompt_len - len(short_ids)] == pad).all()
    assert task.prompt_ids[1, 0] == tokenizer.bos_token_id  # the longest prompt has no padding
    assert task.block_size == task.prompt_len + 8


def test_sample_prompts_is_a_function_of_the_generator(tokenizer):
    task = PromptTask.from_file(EXAMPLES, tokenizer)
    a = task.sample_prompts(8, torch.Generator().manual_seed(3))
    b = task.sample_prompts(8, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert len(set(a[1])) >= 2
    many, answers = task.sample_prompts(3 * len(task.examples), torch.Generator().manual_seed(0))
    assert many.shape == (3 * len(task.examples), task.prompt_len) and len(answers) == len(many)


def test_every_example_character_is_in_the_tiny_vocabulary(tokenizer):
    unk = tokenizer.unk_token_id
    task = PromptTask.from_file(EXAMPLES, tokenizer)
    assert not (task.prompt_ids == unk).any()


def test_reward_decodes_up_to_the_first_eos(tokenizer):
    task = PromptTask.from_file(EXAMPLES, tokenizer)
    eos, pad = task.tokenizer.eos_id, task.tokenizer.pad_id
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    responses = [enc("= 25") + [eos, pad], enc("25") + [eos] + enc("9"), enc("2") + enc("5x")]
    width = max(map(len, responses))
    responses = [r + [pad] * (width - len(r)) for r in responses]
    rewards = task.reward(torch.tensor(responses), ["25", "25", "25"])
    assert rewards.tolist() == [1.0, 1.0, 1.0]  # text after EOS never counts; no EOS: all of it
    assert task.reward(torch.tensor(responses), ["24", "9", "5"]).tolist() == [0.0, 0.0, 0.0]
