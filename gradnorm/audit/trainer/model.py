"""The probe model: a standard causal LM whose every token's gradient lands in a cell of its own.

A Llama with no decoder layer is three tensors: an embedding E (V, V), a final RMSNorm with weight
g (V,), and an LM head H (V, V). The probe sets

    E = I (the identity)     g = sqrt(1/V) (eps = 0)     H = 0

so the hidden state of input id k is exactly the one-hot e_k (RMSNorm of e_k is e_k * sqrt(V),
and V = 4**n makes sqrt(V) and 1/V exact in floating point), and every logit is zero: the next
token's distribution p is uniform, 1/V each. The gradient of the head is then

    dH[:, k] = sum over positions with input id k of  (dloss/dlogits at that position)

a column per input id. For a loss that weighs position (k -> y) by w and has slope a there
(cross-entropy: dl/dlogits = w * a * (p - e_y), a = 1), column k reads

    dH[y, k] = p_y * sum_pos w*a  -  sum_{pos with label y} w*a,

and the row ``SINK`` (an id no data set ever uses as a label) holds the first term alone, so
every (input id, label) pair's w * a = dH[SINK, k] - dH[y, k], exactly (``gradnorm.audit.trainer.readout``).
The data sets (``gradnorm.audit.trainer.data``) give every content position an id of its own, so a pair
names one token of one sequence, whatever rank, microbatch or pack it went to. Shared ids (EOS,
padding) are told apart by their labels, which are unique.

A probe for a trainer that generates (GRPO) needs ragged lengths and no special id sampled, so its
head is one column repeated: every content id's logit 0, EOS's log(C * q / (1 - q)) so that EOS
follows any token with probability q (``EOS_PROBABILITY``), the other specials -1e4 (probability
exactly 0 in fp32). p is then the same known vector after every input id (``next_token_probs``),
and the readout takes any content row a column does not use as a label for its base.

Because it is an ordinary ``LlamaForCausalLM`` saved with ``save_pretrained``, any script loads it
with ``AutoModelForCausalLM.from_pretrained`` and no remote code; TRL's fused LM-head path reads
``last_hidden_state`` and ``get_output_embeddings()`` as it would on a real model.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

PAD, BOS, EOS, UNK = 0, 1, 2, 3
FIRST_CONTENT = 4  # ids FIRST_CONTENT .. V - 2 are the data sets' positions
SPECIALS = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS, "<unk>": UNK}


def vocab_size_for(num_ids: int) -> int:
    """The smallest V = 4**n (n >= 4) with room for ``num_ids`` content ids, the specials and the sink."""
    V = 256
    while V - FIRST_CONTENT - 1 < num_ids:
        V *= 4
    return V


def sink(vocab_size: int) -> int:
    """The id no data set uses: its row of the head's gradient holds p_y * sum(w * a) alone."""
    return vocab_size - 1


def token_text(token_id: int) -> str:
    """The word the probe's tokenizer maps to ``token_id`` (content ids are ``t<id>``)."""
    for word, i in SPECIALS.items():
        if i == token_id:
            return word
    return f"t{token_id}"


EOS_PROBABILITY = 0.25
"""A generating probe's chance of ending after any token: lengths 1, 2, ... with mean 4, cut at the trainer's max."""
BLOCKED = -1e4  # a logit whose exp is exactly 0 in fp32


def column_logits(vocab_size: int, generating: bool):
    """(V,) float64: the logits the probe gives after any input id; all 0 unless it ``generating``."""
    import torch

    logits = torch.zeros(vocab_size, dtype=torch.float64)
    if generating:
        content = vocab_size - FIRST_CONTENT - 1  # C: ids FIRST_CONTENT .. V - 2
        logits[[PAD, BOS, UNK, sink(vocab_size)]] = BLOCKED
        logits[EOS] = math.log(content * EOS_PROBABILITY / (1 - EOS_PROBABILITY))
    return logits


def next_token_probs(vocab_size: int, generating: bool):
    """(V,) float64: p, the probe's next-token distribution after any input id, at its first step."""
    import torch

    return torch.softmax(column_logits(vocab_size, generating), 0)


_IMPORTING = threading.Lock()
"""transformers resolves its names lazily, and two threads resolving them at once can fail ("cannot
import name 'LlamaConfig'"): audits run side by side in threads (notebook 07) import under this lock."""


def write_probe(directory: str | Path, vocab_size: int, generating: bool = False) -> Path:
    """Write the probe (model and tokenizer) to ``directory``, loadable with ``from_pretrained``."""
    import torch

    with _IMPORTING:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging

    logging.disable_progress_bar()  # "Writing model shards" says nothing to an audit's reader

    if vocab_size < 256 or vocab_size & (vocab_size - 1) or vocab_size.bit_length() % 2 == 0:
        raise ValueError(f"vocab_size must be a power of 4 >= 256 (1/V and sqrt(V) exact), got {vocab_size}")
    directory = Path(directory)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=vocab_size, intermediate_size=4, num_hidden_layers=0,
                         num_attention_heads=1, num_key_value_heads=1, rms_norm_eps=0.0, tie_word_embeddings=False,
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, max_position_embeddings=4096,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size))  # hidden state of id k: e_k
        model.model.norm.weight.fill_(vocab_size ** -0.5)  # undoes RMSNorm's sqrt(V) on a one-hot, exactly
        model.lm_head.weight.copy_(column_logits(vocab_size, generating).unsqueeze(-1).expand(-1, vocab_size))
        # every column the same: p after any input id is softmax(column_logits), 1/V each unless generating
    model.generation_config.pad_token_id = PAD
    model.save_pretrained(directory)
    _tokenizer(vocab_size).save_pretrained(directory)
    (directory / "gradnorm_probe.json").write_text(json.dumps({"vocab_size": vocab_size, "sink": sink(vocab_size),
                                                               "generating": generating}))
    return directory


def _tokenizer(vocab_size: int):
    """A word-level tokenizer: ``t<id>`` is id ``id``, words are split on whitespace, nothing is added."""
    with _IMPORTING:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit
        from transformers import PreTrainedTokenizerFast

    vocab = {token_text(i): i for i in range(vocab_size - 1)} | {"<sink>": sink(vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", model_max_length=4096)
