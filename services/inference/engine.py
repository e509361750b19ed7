"""The reference engine: a Hugging Face causal LM that returns, per prompt, the states a drafter (EAGLE-3,
DFlash) learns from. Same contract as SGLang with eaglet's plugin, built on transformers.

Captured: the residual stream entering layers ``aux_layer_ids``, any number of them (SGLang's convention: capture
point i is the input of layer i, which is ``hidden_states[i]`` in transformers' tuple) and the final layer's
output after the final norm.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.shared.dumpfile import DumpEncoding, dump_forms, encode_forms
from eaglet.shared.layers import default_layer_ids, layer_ids_problem
from eaglet.shared.topk import TOPK_TENSORS, encode_topk, span_rows

log = logging.getLogger(__name__)


@dataclass
class Prefill:
    """One prompt's states on the CPU, named as its dump names them, in the forms its ``DumpEncoding`` asked for
    (shared/dumpfile.py ``dump_forms``), and the token the target predicts next."""

    states: dict[str, torch.Tensor]
    next_token: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.states.values())


class ReferenceEngine:
    def __init__(
        self,
        model_dir: Path,
        *,
        device: str | None = None,
        dtype: str | None = None,
        aux_layer_ids: list[int] | None = None,
    ):
        """``aux_layer_ids``: the layers to capture (None: EAGLE-3's default for the model); ``ValueError`` for ids
        the model cannot give."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = (
            getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        )
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # transformers types ``to`` as a method wrapper that takes the model first
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        config = self.model.config
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.max_positions = getattr(config, "max_position_embeddings", 1 << 30)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_layer_ids(self.num_layers)
        problem = layer_ids_problem(self.aux_layer_ids, self.num_layers)
        if problem:
            raise ValueError(f"EAGLET_AUX_LAYER_IDS={','.join(map(str, self.aux_layer_ids))} ({model_dir}): {problem}")
        log.info("engine: %s on %s (%s), aux layers %s", model_dir, self.device, self.dtype, self.aux_layer_ids)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], encodings: list[DumpEncoding] | None = None) -> list[Prefill]:
        """One forward over a right-padded batch; each prompt gets its own rows back, with what its encoding asks
        for computed on the device before the copy to the host: the top-k distribution in place of the final state,
        fp8-encoded states, 4-bit aux states."""
        lengths = [len(p) for p in prompts]
        ids = torch.full((len(prompts), max(lengths)), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        out = self.model.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), output_hidden_states=True
        )
        final = out.last_hidden_state  # [B, T, H], after the final norm
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1)  # [B, T, K*H]
        last = final[torch.arange(len(prompts)), torch.tensor(lengths) - 1]  # [B, H]
        next_tokens = self.model.lm_head(last).argmax(-1).tolist()
        return [
            self._encode(final[i, :n], aux[i, :n], next_tokens[i], encodings[i] if encodings else DumpEncoding())
            for i, n in enumerate(lengths)
        ]

    def _encode(self, final: torch.Tensor, aux: torch.Tensor, next_token: int, encoding: DumpEncoding) -> Prefill:
        """One prompt's states in the forms ``encoding`` asks for, computed on the device, then copied to the host."""
        parts = dump_forms(encoding)
        forms = encode_forms(final, aux, [parts])
        states = {name: forms[form].cpu() for name, form in parts.items()}
        if encoding.topk:
            rows = span_rows(encoding.topk_rows, 0, final.shape[0])  # the positions asked for, or all
            scored = final if rows is None else final[rows.to(final.device)]
            topk = encode_topk(scored, self.model.lm_head.weight, encoding.topk)
            states.update(zip(TOPK_TENSORS, (t.cpu() for t in topk), strict=True))
        return Prefill(states, next_token)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float):
        """Text generation over a left-padded batch; returns each prompt's new token ids (eos kept)."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sample = temperature > 0
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=None,
            pad_token_id=pad,
        )
        eos = self.tokenizer.eos_token_id
        results = []
        for row in out[:, width:].tolist():
            if eos in row:
                row = row[: row.index(eos) + 1]
            results.append(row)
        return results
