"""Extraction on 2 GPUs, then training on 1 of them once the inference server released them: the GPU handoff.

    bash bench/gpu/handoff.sh                 (on a 2-GPU machine that ran bench/gpu/install.sh; about 3 minutes)

The production path, in processes: the trainer service (``eaglet.services.trainer.follow``, EAGLET_TRAIN_GPUS=1,
that is GPU 1 alone) is started first and waits; the inference supervisor (``eaglet.services.inference.release``)
runs SGLang 0.5.17 with eaglet's plugin at TP 2 on GPUs 0,1 over a tiny random-weight Llama (8 layers, hidden 512,
bench/gpu/familymodels.py); 4 extractor workers extract 64 samples; the supervisor stops SGLang and records the
GPUs it released; torchrun starts 1 trainer process on GPU 1 for a few steps. GPU memory is sampled throughout.
Checks and figures: $OUT/handoff.json. Every process gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1, and SGLang at TP 2 --disable-custom-all-reduce
--enforce-disable-flashinfer-allreduce-fusion.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.gpu import familymodels
from bench.gpu import (
    harness as H,  # the GPU bench's process, Redis and pipeline helpers; importing it makes its folders
)

HERE = Path(__file__).resolve().parent


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)
INFERENCE_GPUS, TRAIN_GPUS = "0,1", "1,"  # N = 2 for extraction; M = 1 (GPU 1) for training
SAMPLES, WORKERS, STEPS = 64, 4, 5
DB = 3  # a Redis database of its own: runs left by other phases must not keep the server from releasing
SGLANG_FLAGS = ["--tp-size", "2", "--disable-custom-all-reduce", "--enforce-disable-flashinfer-allreduce-fusion",
                "--chunked-prefill-size", "256", "--mem-fraction-static", "0.3", "--cuda-graph-max-bs", "8",
                "--attention-backend", "triton", "--sampling-backend", "pytorch"]  # fmt: skip
TRAIN_ARGS = f"--max-steps {STEPS} --tokens-per-batch 2048 --max-len 512 --checkpoint-every 100000 --loader-workers 1"
R: dict = {"checks": {}}


class GpuMemory(H.Sampler):
    """Samples each GPU's used memory (MiB) once a second, with the run's stage at that moment."""

    interval_s = 1.0

    def __init__(self, stage):
        self.stage, self.samples = stage, []

    def sample(self) -> None:
        self.samples.append({"t": round(time.time() - H.T0, 1), "stage": self.stage(), "mib": H.gpu_memory_mib()})


def check(name: str, ok: bool, detail: object) -> None:
    R["checks"][name] = {"ok": bool(ok), "detail": detail}
    H.log(f"check {name}: {'ok' if ok else 'FAILED'} ({detail})")


def main() -> int:
    H.redis_up()
    H.REDIS_URL = H.REDIS_URL.rsplit("/", 1)[0] + f"/{DB}"  # the pipeline helper and eaglet_env read it
    from redis import Redis

    from eaglet.shared.runstate import RunState

    redis = Redis.from_url(H.REDIS_URL, decode_responses=True)
    redis.flushdb()
    model = H.ROOT / "models" / "fam-llama"
    familymodels.make_model("llama", model, H.S / "tokenizer")
    dataset = H.ROOT / "handoff.jsonl"
    H.pretokenized(dataset, [20 + (i * 37) % 380 for i in range(SAMPLES)], familymodels.DEFAULT_VOCAB - 1, seed=5)
    run_id = f"handoff-{int(time.time())}"
    state = RunState(redis, run_id)
    env = {**H.eaglet_env(model, H.SGL_PORT), **NO_MULTICAST, "EAGLET_RELEASE_GPUS_WHEN_DONE": "true"}
    R.update(
        {
            "run": run_id,
            "inference_gpus": INFERENCE_GPUS,
            "train_gpus": TRAIN_GPUS,
            "samples": SAMPLES,
            "torchrun": shutil.which("torchrun"),
            "sglang_flags": " ".join(SGLANG_FLAGS),
            "train_args": TRAIN_ARGS,
        }
    )
    if R["torchrun"] is None:  # the trainer service starts its processes with torchrun
        check("torchrun_on_path", False, f"no torchrun on PATH ({os.environ.get('PATH')})")
        (H.OUT / "handoff.json").write_text(json.dumps(R, indent=1, default=str))
        return 1
    memory = GpuMemory(lambda: str(state.stage()) if state.exists() else "none").start()
    try:
        trainer_env = {**env, "EAGLET_TRAIN_GPUS": TRAIN_GPUS, "EAGLET_TRAIN_ARGS": TRAIN_ARGS,
                       "EAGLET_FOLLOW_POLL_S": "1"}  # fmt: skip
        H.start("handoff-trainer", [sys.executable, "-m", "eaglet.services.trainer.follow"], H.PY_EAGLET, trainer_env)
        launch = [
            sys.executable,
            "-m",
            "eaglet.services.inference.sglang_launch",
            "--model-path",
            str(model),
            "--dump-dir",
            str(H.DUMPS),
            "--host",
            "127.0.0.1",
            "--port",
            str(H.SGL_PORT),
            *SGLANG_FLAGS,
        ]
        supervisor = [sys.executable, "-m", "eaglet.services.inference.release", "--", *launch]
        H.DUMPS.mkdir(parents=True, exist_ok=True)
        H.start("handoff-inference", supervisor, H.PY_SGL_PLUGIN, {**env, "EAGLET_RELEASE_POLL_S": "1",
                "CUDA_VISIBLE_DEVICES": INFERENCE_GPUS})  # fmt: skip
        R["sglang_startup_s"] = round(H.wait_health("handoff-inference", H.SGL_PORT, 300), 1)
        p = H.pipeline(run_id, model, dataset, H.SGL_PORT, WORKERS, 8192, timeout=120)
        R["extraction"] = {k: p.get(k) for k in ("samples", "tokens", "counts", "failures", "complete", "wall_s")}
        counts = p.get("counts") or {}
        check("extraction_complete", p.get("complete") and int(counts.get("done", 0)) == SAMPLES,
              {"done": counts.get("done"), "failed": counts.get("failed")})  # fmt: skip
        supervisor_rc = H.PROCS["handoff-inference"].wait(120)
        meta = state.meta()
        check("server_released_its_gpus", supervisor_rc == 0 and meta.released_gpus == ["0", "1"],
              {"supervisor_exit": supervisor_rc, "released_gpus": meta.released_gpus})  # fmt: skip
        deadline = time.time() + 150
        while state.stage() not in ("done", "failed") and time.time() < deadline:
            time.sleep(1)
        meta, train = state.meta(), state.train()
        R["train"] = {"stage": str(state.stage()), "error": meta.error, "step": train.step, "loss": train.loss,
                      "world_size": train.world_size, "device": train.device, "tokens_per_s": train.tokens_per_s,
                      "started_at": train.started_at, "gpus_released": meta.gpus_released}  # fmt: skip
        check("trained_after_release", state.stage() == "done" and train.step == STEPS
              and (train.started_at or 0) >= (meta.gpus_released or float("inf")), R["train"])  # fmt: skip
        check("one_process_on_one_gpu", train.world_size == 1 and str(train.device).startswith("cuda"),
              {"world_size": train.world_size, "device": train.device})  # fmt: skip
        trainer_log = (H.LOGS / "handoff-trainer.log").read_text(errors="replace")
        check("torchrun_m_processes", "torchrun --standalone --nproc-per-node 1" in trainer_log,
              [line for line in trainer_log.splitlines() if "torchrun" in line][:2])  # fmt: skip
    finally:
        memory.stop()
        samples = memory.samples
        H.stop_all()
        R["gpu_memory_mib"] = samples
    extracting = [s["mib"] for s in samples if s["stage"] == "extracting" and s["mib"]]
    training = [s["mib"] for s in samples if s["stage"] == "training" and s["mib"]]
    check("inference_held_both_gpus", bool(extracting) and min(m[0] for m in extracting) > 1024
          and min(m[1] for m in extracting) > 1024, {"samples": len(extracting)})  # fmt: skip
    check("trainer_used_gpu_1_alone", bool(training) and max(m[0] for m in training) < 1024
          and max(m[1] for m in training) > 256,
          {"samples": len(training), "gpu0_max": max((m[0] for m in training), default=None),
           "gpu1_max": max((m[1] for m in training), default=None)})  # fmt: skip
    R["ok"] = all(c["ok"] for c in R["checks"].values())
    R["wall_s"] = round(time.time() - H.T0, 1)
    (H.OUT / "handoff.json").write_text(json.dumps(R, indent=1, default=str))
    H.log(f"handoff: {'all checks passed' if R['ok'] else 'FAILED'}; {H.OUT / 'handoff.json'}")
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
