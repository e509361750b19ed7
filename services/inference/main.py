"""Entry point of the reference inference server: ``python -m eaglet.services.inference.main``."""

import argparse
from typing import Annotated

import uvicorn
from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from eaglet.services.inference.batcher import Batcher
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.inference.server import create_app
from eaglet.shared.config import Settings
from eaglet.shared.dumpwriter import DEFAULT_CAP_BYTES, DEFAULT_THREADS, DumpWriter
from eaglet.shared.layers import parse_layer_ids
from eaglet.shared.logs import setup_logging
from eaglet.shared.target import resolve_model_dir


class InferenceSettings(Settings):
    model_config = SettingsConfigDict(env_prefix="EAGLET_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 30000
    device: str | None = None
    """``cuda`` or ``cpu``; the GPU when there is one."""
    dtype: str | None = None
    """``bfloat16``, ``float32``...; bf16 on GPU, fp32 on CPU by default."""
    dump: bool = True
    """Write dumps for eaglet's requests. Off only to measure the server alone."""
    max_batch_tokens: int = 16384
    max_batch_size: int = 64
    dump_queue_bytes: int = Field(DEFAULT_CAP_BYTES, gt=0)
    """Most bytes of dumps held in memory waiting for the dump folder; when full, the engine waits (back-pressure,
    shown in /status). SGLang's plugin reads the same variable."""
    dump_writer_threads: int = Field(DEFAULT_THREADS, gt=0)
    """Dumps written at once. SGLang's plugin reads the same variable."""
    aux_layer_ids: Annotated[list[int] | None, NoDecode] = None
    """``EAGLET_AUX_LAYER_IDS``, comma-separated (``2,15,27``; SGLang's plugin reads the same variable): the layers
    whose input every dump captures, any number of them (EAGLE-3's and DFlash's together serve runs of both). Unset:
    EAGLE-3's ``default_layer_ids(L)``. Checked against the model's layers at start."""

    @field_validator("aux_layer_ids", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return parse_layer_ids(value, "EAGLET_AUX_LAYER_IDS") if isinstance(value, str) and value else value or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int)
    parser.add_argument("--model")
    parser.add_argument("--no-dump", action="store_true")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"port": args.port, "model": args.model}.items() if v is not None}
    if args.no_dump:
        overrides["dump"] = False
    settings = InferenceSettings(**overrides)
    setup_logging()
    engine = ReferenceEngine(
        resolve_model_dir(settings.model, settings.model_cache_dir),
        device=settings.device,
        dtype=settings.dtype,
        aux_layer_ids=settings.aux_layer_ids,
    )
    batcher = Batcher(
        engine,
        DumpWriter(settings.dump_dir, cap_bytes=settings.dump_queue_bytes, threads=settings.dump_writer_threads),
        dump=settings.dump,
        max_batch_tokens=settings.max_batch_tokens,
        max_batch_size=settings.max_batch_size,
    )
    uvicorn.run(create_app(engine, batcher), host=settings.host, port=settings.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
