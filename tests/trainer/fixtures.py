"""Builds a run as the extraction pipeline leaves it: ingested samples, stored hidden states of a tiny Llama, the
run meta and the done bitmap in Redis."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eaglet.shared.layers import default_layer_ids
from eaglet.shared.layout import Layout
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleWriter
from eaglet.shared.store import sample_path, samples_dir, write_sample
from eaglet.shared.topk import TOPK_TENSORS, encode_topk


def token_sequences(n: int, length: int, seed: int = 0, vocab: tuple[int, int] = (200, 260)) -> list[list[int]]:
    """Patterned sequences (arithmetic runs over a small id range): something a drafter can learn in seconds."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = vocab
    out = []
    for _ in range(n):
        start, stride = int(torch.randint(lo, hi, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        out.append([lo + (start - lo + stride * i) % (hi - lo) for i in range(length - (len(out) % 3))])
    return out


@torch.no_grad()
def make_run(
    redis,
    data_dir: Path,
    model_dir: Path,
    run_id: str,
    *,
    n: int = 24,
    length: int = 40,
    complete: bool = True,
    store_dtype: str = "model",
    layout: Layout = Layout(),
    texts: list[list[int]] | None = None,
    layer_ids: list[int] | None = None,
    options: RunOptions | None = None,
) -> list[int]:
    """Writes ``n`` samples (``texts``' token ids, else patterned sequences) and the run state, stored as
    ``store_dtype`` in ``layout`` (a top-k computed as the reference server does); marks all done (``complete``)
    or all but the last; captured at ``layer_ids`` (EAGLE-3's default when None). Returns layer ids."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    layer_ids = layer_ids or default_layer_ids(layers)
    state = RunState(redis, run_id)
    state.create(model_dir=str(model_dir), hidden_size=model.config.hidden_size, num_layers=layers,
                 aux_layer_ids=layer_ids, options=options)  # fmt: skip
    writer = SampleWriter(samples_dir(data_dir, run_id))
    seqs = texts if texts is not None else token_sequences(n, length)
    for i, ids in enumerate(seqs):
        mask = [0] * (len(ids) // 3) + [1] * (len(ids) - len(ids) // 3)
        writer.append(f"s{i:04d}", ids, mask)
        out = model.model(torch.tensor([ids]), output_hidden_states=True)
        tensors = {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "hidden_states": out.last_hidden_state[0],  # after the final norm
            "aux_hidden_states": torch.cat([out.hidden_states[j][0] for j in layer_ids], -1),
        }
        if layout.final == "topk":
            topk = encode_topk(tensors["hidden_states"], model.lm_head.weight, layout.topk)
            tensors.update(zip(TOPK_TENSORS, topk, strict=True))
        path = sample_path(data_dir, run_id, f"s{i:04d}")
        write_sample(path, tensors, {"aux_layer_ids": json.dumps(layer_ids)}, store_dtype=store_dtype, layout=layout)
    writer.close({"model": str(model_dir)})
    state.set_total(n, sum(len(s) for s in seqs))
    for i, ids in enumerate(seqs):
        if complete or i < n - 1:
            state.mark_done(i, len(ids), 0)
    return layer_ids
