"""eaglet's drafter against SpecForge 0.2.0's on the bundled SmolLM2-135M-Instruct, on one H200, in phases
(bench/gpu/README.md has the call sequence). Results in $OUT/<phase>.json; the table via bench/gpu/h2hreport.py.

    python3 -m bench.gpu.headtohead PHASE [PHASE...]     (from the repo root, after bench/gpu/install.sh)

Phases (each skipped when an earlier call finished it; state in $GPUBENCH_ROOT/gpubench-results.json):
  h2h-data       the conversations committed under data/h2h/ when there are any; else SGLang with eaglet's
                 plugin on the real SmolLM2: the target writes its own prompts (Magpie: sampled from its chat
                 template's user prefix, deduplicated, filtered); a share of conversations gets a second user
                 turn, sampled after the target's first answer; eaglet's regeneration stage (extractor workers ->
                 the server's /v1/chat/completions, greedy) answers every user turn; a held-out share of prompts
                 is set apart and never ingested. The files are written to $OUT, to be committed.
  h2h-extract    the conversations through eaglet: ingest, the same server with the plugin, extractor workers,
                 the store.
  h2h-eaglet     eaglet's trainer, default recipe, H2H_EPOCHS epochs (checkpoints only at the end).
  h2h-specforge  the same training samples (eaglet's own held-out split left out) as SpecForge offline features,
                 SpecForge's `specforge train` (its defaults; same epochs, same samples per optimizer step),
                 its SGLang export.
  h2h-score      both drafters' accuracy per draft position on eaglet's held-out samples, by eaglet's scorer.
  h2h-eval       one plain SGLang build, every server in one call: the target alone (HumanEval twice, at two
                 concurrencies), then each drafter at H2H_CHAINS ((3, 1, 4)), on the 164 HumanEval prompts and the
                 held-out prompts, greedy: accept length, acceptance per draft position, output tokens/s, outputs
                 equal to the target alone's.
  h2h-trainspeed eaglet's trainer alone, each variant of H2H_TRAINSPEED (eager, compiled) in turn, repeated: tokens/s
                 beside h2h-specforge's, held-out figures.
  h2h-layouts    h2h-extract's samples stored again in each storage layout of H2H_LAYOUTS (the top-k computed on the
                 GPU from the stored final states by the servers' encoder), one run a layout; the recipes
                 ``layout-<name>`` of H2H_ABLATIONS train the default recipe on them (h2h-ablate-train/-eval).
  h2h-report     $OUT/gpu-headtohead.md and .json.
  dfl-*          eaglet's DFlash drafters trained and served by SGLang (bench/gpu/h2hdflash.py).
"""

from bench.gpu import h2h, h2hablate, h2hdata, h2hdflash, h2heval, h2hreport, h2htrain
from bench.gpu import harness as P


def phase_report() -> None:
    for phase in (*h2hreport.PHASES, h2hablate.ABLATED):
        P.save(phase)
    h2hreport.write(P.OUT, P.OUT)


PHASES = {
    "h2h-data": h2hdata.phase_data,
    "h2h-extract": h2hdata.phase_extract,
    "h2h-eaglet": h2htrain.phase_eaglet,
    "h2h-specforge": h2htrain.phase_specforge,
    "h2h-score": h2heval.phase_score,
    "h2h-eval": h2heval.phase_eval,
    "h2h-trainspeed": h2hablate.phase_trainspeed,
    "h2h-extract-fp8": h2hdata.phase_extract_fp8,
    "h2h-layouts": h2hablate.phase_layouts,
    "h2h-ablate-train": h2hablate.phase_ablate_train,
    "h2h-ablate-eval": h2hablate.phase_ablate_eval,
    "h2h-gate": h2hablate.phase_gate,
    "h2h-report": phase_report,
    **h2hdflash.PHASES,
}


ESTIMATE_S = {
    # 10,002 conversations took 487 s, their extraction 60 s (one H200): per conversation, plus a server start
    "h2h-data": lambda: 5 if (h2h.KEPT / "train.jsonl.gz").exists() else 70 + h2h.N_CONV * 0.045,
    "h2h-extract": lambda: 70 + h2h.conversations() * 0.01,
    "h2h-eaglet": h2htrain.estimate_eaglet,
    "h2h-specforge": h2htrain.estimate_specforge,
    "h2h-score": 60,
    "h2h-eval": 450,  # three server starts of ~55 s, five prompt-set decodes of ~45 s, the repeat
    "h2h-trainspeed": lambda: h2hablate.estimate_trainspeed_row("", True),  # one row at least; the rest by their own
    "h2h-extract-fp8": lambda: 70 + h2h.conversations() * 0.01,
    "h2h-layouts": lambda: 10 + h2h.conversations() * 0.004,  # a re-encode of each sample a layout, no server
    "h2h-ablate-train": 90,  # the recipes resume from their checkpoints: any minute of training is kept
    "h2h-ablate-eval": 150,
    "h2h-gate": 1,
    "h2h-report": 5,
    **h2hdflash.ESTIMATE_S,
}


if __name__ == "__main__":
    from bench.gpu import phases

    raise SystemExit(P.main({**phases.PHASES, **PHASES}, {**phases.ESTIMATE_S, **ESTIMATE_S}))
