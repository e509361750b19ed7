"""The scenarios behind test_sglang_plugin.py, played inside the SGLang venv (no tests here).

``python test_sglang_plugin_cases.py cases OUT`` runs every case in one process against SGLang's real
classes and writes ``OUT/results.json`` and the dumps under ``OUT/dumps``; test_sglang_plugin.py
runs it with the SGLang venv's Python and checks the results. See that file for what is real and
what is a stand-in. Hooks patch SGLang's classes, so this always runs in a process of its own.
"""

import json
import os
import sys
from pathlib import Path

H = 32  # hidden size of the stand-in model (4-bit aux states need 3H in blocks of 32)
LAYERS = 8  # -> EAGLE-3 layers [2, 4, 5]
VOCAB = 300  # of the stand-in model directory's LM head


def _cases(out: Path) -> dict:
    import time
    from array import array
    from types import SimpleNamespace

    import torch

    dumps = out / "dumps"
    os.environ["EAGLET_DUMP_DIR"] = str(dumps)
    os.environ["SGLANG_PLUGINS"] = "eaglet_dump"

    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.sampling.sampling_params import SamplingParams

    # 0.5.23 fills LogitsProcessorOutput.last_hidden_states in capture-only mode; 0.5.17 has no such field
    native = "last_hidden_states" in LogitsProcessorOutput.__dataclass_fields__
    rank = {"tp": 0, "cp": 0}
    parallel_state.get_attn_tensor_model_parallel_rank = lambda: rank["tp"]
    parallel_state.get_attn_context_model_parallel_rank = lambda: rank["cp"]

    def standin_logits_forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux=None, before=None):
        return LogitsProcessorOutput(next_token_logits=None)

    def standin_forward(self, batch, forward_batch=None, *args, **kwargs):
        # Rows in batch order, extend_lens[i] rows per request, token ids encoded in the values, one H-wide block
        # per captured layer; 5 rows of NaN padding at the end, as a CUDA graph's static buffers may carry.
        ids, pos = [], []
        for req, prefix, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, strict=True):
            fill = list(req.origin_input_ids) + list(req.output_ids)
            ids += fill[prefix : prefix + ext]
            pos += list(range(prefix, prefix + ext))
        n = len(ids)
        final = torch.full((n + 5, H), float("nan"))
        num_aux = len(self._model_runner.model.model.layers_to_capture)
        aux = torch.full((n + 5, num_aux * H), float("nan"))
        t_ids, t_pos = torch.tensor(ids, dtype=torch.float32), torch.tensor(pos, dtype=torch.float32)
        final[:n] = 0.5
        final[:n, 0], final[:n, 1] = t_ids, t_pos
        for k in range(num_aux):
            aux[:n, k * H : (k + 1) * H] = (t_ids + 10 * (k + 1))[:, None]
        final, aux = final.to(self.standin_dtype), aux.to(self.standin_dtype)
        if self.standin_native_final:  # 0.5.23 with its capture flag
            out = LogitsProcessorOutput(next_token_logits=None, hidden_states=aux, last_hidden_states=final)
        else:  # 0.5.17: the plugin enables capture; only the logits processor sees the final states
            LogitsProcessor.forward(None, None, final, None, None, aux)
            out = LogitsProcessorOutput(next_token_logits=None, hidden_states=aux)
        return GenerationBatchResult(logits_output=out)

    TpModelWorker.forward_batch_generation = standin_forward
    LogitsProcessor.forward = standin_logits_forward
    ModelRunner.init_attention_backends = lambda self: None

    from sglang.srt.plugins import load_plugins

    load_plugins()
    import eaglet_sglang

    plugin = eaglet_sglang.PLUGIN
    import sglang

    results: dict = {
        "version": sglang.__version__,
        "native_final_states": native,
        "load": {
            "wrapped": {
                "forward": getattr(TpModelWorker.forward_batch_generation, "__wrapped__", None) is standin_forward,
                "init_attention": hasattr(ModelRunner.init_attention_backends, "__wrapped__"),
                "logits": getattr(LogitsProcessor.forward, "__wrapped__", None) is standin_logits_forward,
            }
        },
    }

    def standin_model(layers_to_capture=None):
        model = SimpleNamespace(
            pp_group=SimpleNamespace(is_last_rank=True),
            config=SimpleNamespace(num_hidden_layers=LAYERS),
            model=SimpleNamespace(layers_to_capture=[], layers=[SimpleNamespace() for _ in range(LAYERS)]),
            logits_processor=LogitsProcessor.__new__(LogitsProcessor),
            capture_aux_hidden_states=False,
        )
        model.set_eagle3_layers_to_capture = lambda ids=None: LlamaForCausalLM.set_eagle3_layers_to_capture(model, ids)
        if layers_to_capture is not None:
            model.capture_aux_hidden_states = True
            model.model.layers_to_capture = layers_to_capture
        return model

    def new_worker(native_final=native, dtype=torch.float32, model_path="/models/tiny-llama"):
        runner = ModelRunner.__new__(ModelRunner)
        runner.is_draft_worker = False
        runner.server_args = SimpleNamespace(
            cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))
        )
        runner.model = standin_model()
        runner.init_attention_backends()  # hooked: enables capture, as at server start
        worker = TpModelWorker.__new__(TpModelWorker)
        worker._model_runner = runner
        worker.server_args = SimpleNamespace(served_model_name="tiny-llama", model_path=model_path)
        worker.standin_native_final, worker.standin_dtype = native_final, dtype
        return worker

    def sampling(custom_params=None):
        params = SamplingParams(max_new_tokens=1, temperature=0, custom_params=custom_params)
        params.normalize(None)
        params.verify(vocab_size=1000)
        return params

    sp = sampling()

    def req(rid, prompt, params=sp):
        return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", prompt), sampling_params=params)

    def forward(worker, parts, mode=ForwardMode.EXTEND, decoding=None):
        """parts: (req, prefix_len, extend_len) in row order."""
        batch = ScheduleBatch(
            reqs=[p[0] for p in parts],
            forward_mode=mode,
            prefix_lens=[p[1] for p in parts],
            extend_lens=[p[2] for p in parts],
            decoding_reqs=decoding,
        )
        result = worker.forward_batch_generation(batch)
        plugin.flush()
        return result

    def prompt(n, base):
        return [base + i for i in range(n)]

    def files():
        return {p.name for p in dumps.iterdir()} if dumps.exists() else set()

    w = new_worker()

    # Interleaved: two eaglet requests around a health check, one forward.
    pa, pb = prompt(5, 10), prompt(7, 40)
    a, hc, b = req("eaglet:run1:s-a:0", pa), req("HEALTH_CHECK_1", prompt(3, 1)), req("eaglet:run1:s-b:0", pb)
    forward(w, [(a, 0, 5), (hc, 0, 3), (b, 0, 7)])
    results["interleaved"] = {"prompts": {a.rid: pa, b.rid: pb}}

    # Chunked prefill: 10 tokens in chunks of 4, 4, 2; another request joins the second forward.
    pc, pd = prompt(10, 60), prompt(3, 80)
    c, d = req("eaglet:run1:s-c:0", pc), req("eaglet:run1:s-d:0", pd)
    exists = []
    for parts in ([(c, 0, 4)], [(d, 0, 3), (c, 4, 4)], [(c, 8, 2)]):
        forward(w, parts)
        exists.append(f"{c.rid}.safetensors" in files())
    results["chunked"] = {
        "rid": c.rid,
        "prompt": pc,
        "exists_after_chunk": exists,
        "other_rid": d.rid,
        "other_prompt": pd,
    }

    # A mixed batch: one prefill plus a running request's decode row; then a pure decode batch.
    pe, pf = prompt(4, 90), prompt(3, 95)
    e, f = req("eaglet:run1:s-e:0", pe), req("eaglet:run1:s-f:0", pf)
    f.output_ids = [7, 8]
    forward(w, [(e, 0, 4), (f, 4, 1)], mode=ForwardMode.MIXED, decoding=[f])
    before = files()
    decode_result = forward(w, [(f, 4, 1)], mode=ForwardMode.DECODE)
    results["mixed"] = {
        "rid": e.rid,
        "prompt": pe,
        "decode_rid": f.rid,
        "decode_batch_result_passed_through": decode_result.logits_output is not None and files() == before,
    }

    # Warm-up only.
    before = files()
    warm = forward(w, [(req("warmup-0", prompt(6, 1)), 0, 6)])
    results["warmup"] = {
        "result_passed_through": warm.logits_output is not None,
        "new_files": sorted(files() - before),
    }

    # Aborted after its first chunk: dropped once the timeout passes; a late chunk is not written.
    g = req("eaglet:run1:s-g:0", prompt(8, 100))
    forward(w, [(g, 0, 4)])
    pending_before = plugin.collector.pending
    clock = time.monotonic()
    plugin.collector.clock = lambda: clock + plugin.settings.timeout_s + 1
    expired = plugin.collector.expire()
    pending_after = plugin.collector.pending
    plugin.collector.clock = time.monotonic
    results["aborted"] = {
        "rid": g.rid,
        "pending_before": pending_before,
        "expired": expired,
        "pending_after": pending_after,
    }

    # A gap between chunks (radix hit, lost chunk): incomplete, never written; same for a request
    # first seen mid-prompt.
    h, late = req("eaglet:run1:s-h:0", prompt(10, 120)), req("eaglet:run1:s-late:0", prompt(6, 130))
    forward(w, [(h, 0, 4)])
    forward(w, [(h, 6, 4), (late, 3, 3)])
    results["gap"] = {"rid": h.rid, "late_rid": late.rid}

    # Not the writer rank (attention TP rank 1; then CP rank 1): nothing written.
    rids = []
    for tp, cp in ((1, 0), (0, 1)):
        rank.update(tp=tp, cp=cp)
        r = req(f"eaglet:run1:s-rank{tp}{cp}:0", prompt(4, 140))
        forward(new_worker(), [(r, 0, 4)])
        rids.append(r.rid)
    rank.update(tp=0, cp=0)
    results["rank"] = {"rids": rids}

    # Unsafe rids: refused, nothing written anywhere.
    before = files()
    bad = [req("eaglet:../../x:s:0", prompt(3, 1)), req("eaglet:a/b:0", prompt(3, 1))]
    forward(w, [(r, 0, 3) for r in bad])
    results["unsafe"] = {
        "new_files": sorted(files() - before),
        "outside": sorted(p.name for p in out.rglob("*") if p.name.startswith("x:") or p.name.startswith("b:")),
    }

    # 0.5.17-style: no last_hidden_states field filled; final states from the logits hook; bf16.
    ps = prompt(6, 150)
    s = req("eaglet:run1:s-stash:0", ps)
    forward(new_worker(native_final=False, dtype=torch.bfloat16), [(s, 0, 6)])
    results["stash"] = {"rid": s.rid, "prompt": ps}

    # fp8 asked by one of two requests with the same prompt, in one bf16 forward, over two chunks.
    p8 = prompt(9, 200)
    wide = req("eaglet:run1:s-wide:0", p8)
    enc = req("eaglet:run1:s-fp8:0", p8, sampling({"eaglet_dump": "fp8"}))
    w16 = new_worker(dtype=torch.bfloat16)
    forward(w16, [(wide, 0, 5), (enc, 0, 5)])
    forward(w16, [(enc, 5, 4), (wide, 5, 4)])
    results["fp8"] = {"wide_rid": wide.rid, "fp8_rid": enc.rid, "prompt": p8}

    # Top-k over the head of the model directory: asked by one request over three chunks (k = 5), with fp8 by
    # another (k = 3), beside a request that asks neither; the same prompt, so the same final states; bf16.
    from safetensors.torch import save_file

    model_dir = out / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False}))
    # Multiples of 1/16 against the stand-in's integer states: exact logits, however the rows are batched.
    weights = torch.randint(-32, 33, (2, VOCAB, H), generator=torch.Generator().manual_seed(0)) / 16
    save_file(
        {
            "model.embed_tokens.weight": weights[0].to(torch.bfloat16),
            "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
            "lm_head.weight": weights[1].to(torch.bfloat16),
        },
        str(model_dir / "model.safetensors"),
    )
    pk = prompt(10, 160)  # aux values below 256: exact in bf16
    top = req("eaglet:run1:s-topk:0", pk, sampling({"eaglet_topk": 5}))
    both = req("eaglet:run1:s-topk-fp8:0", pk, sampling({"eaglet_topk": 3, "eaglet_dump": "fp8"}))
    plain = req("eaglet:run1:s-no-topk:0", pk)
    # the default layout's request: the top-k in place of the final state, the aux states 4-bit encoded
    default = req("eaglet:run1:s-default:0", pk, sampling({"eaglet_topk": 4, "eaglet_aux": "e2m1_b32"}))
    # ...scored at its loss positions only, the spans across the chunks' boundary
    spans = [[1, 3], [5, 9]]
    at_loss = req("eaglet:run1:s-loss:0", pk, sampling({"eaglet_topk": 4, "eaglet_aux": "e2m1_b32",
                                                        "eaglet_topk_rows": spans}))  # fmt: skip
    wk = new_worker(dtype=torch.bfloat16, model_path=str(model_dir))
    exists = []
    chunks = (
        [(top, 0, 4), (plain, 0, 5), (default, 0, 6), (at_loss, 0, 6)],
        [(plain, 5, 5), (top, 4, 4), (both, 0, 10), (default, 6, 4), (at_loss, 6, 4)],
        [(top, 8, 2)],
    )
    for parts in chunks:
        forward(wk, parts)
        exists.append(f"{top.rid}.safetensors" in files())
    results["topk"] = {
        "model_dir": str(model_dir),
        "prompt": pk,
        "rids": {top.rid: 5, both.rid: 3},
        "plain_rid": plain.rid,
        "default_rid": default.rid,
        "loss_rid": at_loss.rid,
        "loss_spans": spans,
        "exists_after_chunk": exists,
    }

    # Top-k asked where the model path holds no safetensors: no dump for it, one error, the server goes on.
    import logging

    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    logging.getLogger("eaglet_sglang.plugin").addHandler(handler)
    no_head = out / "no-safetensors"
    no_head.mkdir()
    (no_head / "config.json").write_text(json.dumps({"model_type": "llama"}))
    wn = new_worker(model_path=str(no_head))
    asked = [req(f"eaglet:run1:s-nohead{i}:0", prompt(4, 240), sampling({"eaglet_topk": 5})) for i in range(2)]
    other = req("eaglet:run1:s-nohead-plain:0", prompt(4, 240))
    passed = [forward(wn, [(asked[0], 0, 4), (other, 0, 4)]), forward(wn, [(asked[1], 0, 4)])]
    logging.getLogger("eaglet_sglang.plugin").removeHandler(handler)
    results["no_head"] = {
        "model_path": str(no_head),
        "asked": [r.rid for r in asked],
        "other_rid": other.rid,
        "other_prompt": prompt(4, 240),
        "results_passed_through": all(r.logits_output is not None for r in passed),
        "errors": errors,
    }

    # The capture's clock: its line once its interval has passed, with the forwards since the last one.
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("eaglet_sglang.plugin").addHandler(handler)
    from eaglet_sglang.plugin import CaptureClock

    plugin.clock = CaptureClock(every_s=3600.0)  # the forwards of the cases above are not this one's
    wc = new_worker()
    forward(wc, [(req("eaglet:run1:s-clock0:0", prompt(4, 250)), 0, 4)])
    plugin.clock.every_s = 0.0
    forward(wc, [(req("eaglet:run1:s-clock1:0", prompt(4, 260)), 0, 4)])
    forward(wc, [(req("eaglet:run1:s-clock2:0", prompt(4, 270)), 0, 4)])
    logging.getLogger("eaglet_sglang.plugin").removeHandler(handler)
    results["clock"] = [line for line in lines if line.startswith("capture:")]

    # Capture: default layers, chosen layers (SGLang convention), and after the server flag chose others.
    from eaglet_sglang.plugin import DumpPlugin, DumpSettings, captured_layers

    # Five layers (DFlash's count): captured, and dumped five H-wide blocks wide.
    eagle3 = plugin.settings.aux_layer_ids
    plugin.settings.aux_layer_ids = [1, 2, 3, 5, 7]
    w5 = new_worker()
    plugin.settings.aux_layer_ids = eagle3
    five = req("eaglet:run1:s-five:0", prompt(6, 280))
    forward(w5, [(five, 0, 6)])
    results["five_layers"] = {"rid": five.rid, "prompt": prompt(6, 280),
                              "captured": captured_layers(w5._model_runner.model)}  # fmt: skip

    # A side stream asked: on a CPU there is none, the capture runs as on the forward's stream; a bad name refused.
    plugin.settings.capture_stream = "side"
    side = req("eaglet:run1:s-side:0", prompt(5, 290))
    forward(new_worker(), [(side, 0, 5)])
    plugin.settings.capture_stream = "forward"
    try:
        DumpSettings(dump_dir=dumps, capture_stream="async")
        refused = ""
    except ValueError as e:
        refused = str(e)
    try:
        DumpSettings.from_env({"EAGLET_DUMP_DIR": str(dumps), "EAGLET_CAPTURE_LOG_S": "0"})
        every_refused = ""
    except ValueError as e:
        every_refused = str(e)
    every = DumpPlugin(DumpSettings.from_env({"EAGLET_DUMP_DIR": str(dumps), "EAGLET_CAPTURE_LOG_S": "10"})).clock
    results["side_stream"] = {"rid": side.rid, "prompt": prompt(5, 290), "refused": refused,
                              "log_every_refused": every_refused, "log_every_s": every.every_s}  # fmt: skip

    default = standin_model()
    plugin.enable_capture(default)
    chosen = standin_model()
    DumpPlugin(DumpSettings(dump_dir=dumps, aux_layer_ids=[3, 5, 6])).enable_capture(chosen)
    flagged = standin_model(layers_to_capture=[1, 2, 3])
    plugin.enable_capture(flagged)
    results["capture"] = {
        "default": captured_layers(default),
        "chosen": captured_layers(chosen),
        "already_on": captured_layers(flagged),
    }
    return results


if __name__ == "__main__" and sys.argv[1:2] == ["cases"]:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    out_dir = Path(sys.argv[2])
    (out_dir / "results.json").write_text(json.dumps(_cases(out_dir)))
