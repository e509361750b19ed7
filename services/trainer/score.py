"""Held-out figures of any EAGLE-3 drafter saved in SGLang's format, on a run's stored held-out samples.

    python -m eaglet.services.trainer.score --run RUN --drafter NAME=DIR [--drafter NAME=DIR ...]
        [--model TARGET_DIR] [--out FILE.json]

The figures are the trainer's own held-out figures (``train.heldout_figures``, through ``TTTObjective``): the
held-out split by the trainer's rule (``data.is_heldout`` of the sample id, the default held-out fraction unless
told), the same batches, the same loss (forward KL against the target's distribution over the draft vocabulary,
steps weighted ``step_weight ** i``) and the same per-step accuracy (a loss position whose drafter top token is
not the target's top token is a miss; with the OOV mask on, as on GPU by default, one whose target top token is
outside the draft vocabulary is one too). A drafter eaglet trained and one another trainer saved (config.json
without an ``eaglet`` section: ``checkpoint.load_drafter``) are scored by this one code, each over its own draft
vocabulary (``draft_ids = arange(Vd) + d2t``) and with the target's LM head and embedding.

The CLI prints one JSON object, ``{NAME: figures}``, each figures object as ``score_drafter`` returns it.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from redis import Redis

from eaglet.services.trainer import checkpoint as ckpt
from eaglet.services.trainer import data
from eaglet.services.trainer.config import OovMask, TrainConfig
from eaglet.services.trainer.objective import TTTObjective, heldout_figures, objective_options, place
from eaglet.services.trainer.train import read_done
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.logs import setup_logging
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import sample_header, sample_path, samples_dir, state_widths
from eaglet.shared.target import model_config, resolve_model_dir
from eaglet.shared.targettensors import load_target_tensors

log = logging.getLogger(__name__)

DEFAULTS = TrainConfig()


class ScoreError(RuntimeError):
    """A drafter, a target or a run that cannot be scored together (the message says which and why)."""


def score_drafter(
    *, data_dir: Path, run_id: str, target_dir: Path, drafter_dir: Path, device: str | torch.device | None = None,
    ttt_steps: int | None = None, tokens_per_batch: int = DEFAULTS.tokens_per_batch, max_len: int = DEFAULTS.max_len,
    heldout_fraction: float = DEFAULTS.heldout_fraction, oov_mask: OovMask = DEFAULTS.oov_mask,
    redis: Redis | None = None,
) -> dict:  # fmt: skip
    """The held-out figures of the drafter in ``drafter_dir`` on run ``run_id``'s held-out samples::

        {"heldout_loss": float, "heldout_acc": [float] * ttt_steps, "samples": int, "tokens": int,
         "ttt_steps": int, "draft_vocab_size": int, "oov_mask": bool}

    Samples: those of the run whose sample id is held out at ``heldout_fraction``, among the extracted ones (the
    run's done bitmap with ``redis``, else those whose stored file is there). ``ttt_steps`` (None: the trainer's
    default), ``tokens_per_batch`` and ``max_len`` as the trainer's flags of the same names: give the training's
    to reproduce its figures. ``device``: None for CUDA where there is one (bf16 autocast, as the trainer), else
    the CPU (float32)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = TrainConfig(
        ttt_steps=ttt_steps if ttt_steps is not None else DEFAULTS.ttt_steps,
        tokens_per_batch=tokens_per_batch,
        max_len=max_len,
        heldout_fraction=heldout_fraction,
        oov_mask=oov_mask,
    )
    data_dir, drafter_dir = Path(data_dir), Path(drafter_dir)
    items = heldout_items(data_dir, run_id, cfg.heldout_fraction, redis)
    objective = load_objective(Path(target_dir), drafter_dir, cfg, device)
    check_states(objective, data_dir, run_id, items[0], drafter_dir)
    figures = heldout_figures(
        objective,
        items,
        data_dir=data_dir,
        run_id=run_id,
        tokens_per_batch=cfg.tokens_per_batch,
        max_len=cfg.max_len,
        device=device,
    )
    return {
        **figures,
        "ttt_steps": cfg.ttt_steps,
        "draft_vocab_size": objective.drafter.cfg.draft_vocab_size,
        "oov_mask": objective.oov,
    }


def heldout_items(data_dir: Path, run_id: str, fraction: float, redis: Redis | None) -> list[data.Item]:
    """The run's extracted held-out samples, split as the trainer splits them (``data.split_items``)."""
    folder = samples_dir(data_dir, run_id)
    if not (folder / "index.bin").is_file():
        raise ScoreError(f"run {run_id}: no ingested samples in {folder}")
    samples = SampleSet(folder)
    if redis is not None:
        indexes = read_done(redis, run_id, len(samples))
    else:
        indexes = list(range(len(samples)))
    _, held = data.split_items(samples, indexes, fraction)
    if redis is None:  # without the done bitmap: the samples whose stored states are there
        held = [it for it in held if sample_header(sample_path(data_dir, run_id, it.sample_id)) is not None]
    if not held:
        raise ScoreError(
            f"run {run_id}: no extracted held-out samples at held-out fraction {fraction} "
            f"({len(indexes)} of {len(samples)} samples extracted)"
        )
    return held


def load_objective(target_dir: Path, drafter_dir: Path, cfg: TrainConfig, device: torch.device) -> TTTObjective:
    """The trainer's objective around the saved drafter: the target's embedding and LM head, the drafter's own
    draft vocabulary (from its d2t)."""
    tensors = load_target_tensors(target_dir)
    embed, head = tensors["embed"].float(), tensors["lm_head"].float()
    try:
        drafter = ckpt.load_drafter(drafter_dir, embed)
    except ckpt.CheckpointError as e:
        raise ScoreError(str(e)) from e
    dcfg = drafter.cfg
    text = model_config(target_dir)
    text = text.get("text_config", text)
    target_hidden = int(text["hidden_size"])
    problems = [
        f"{name} {mine} but the target's ({target_dir}) is {theirs}"
        for name, mine, theirs in (
            ("vocab_size", dcfg.vocab_size, embed.shape[0]),
            ("hidden_size", dcfg.hidden_size, embed.shape[1]),  # the drafter embeds with the target's embedding
            ("target_hidden_size", dcfg.target_hidden_size, target_hidden),
        )
        if mine != theirs
    ]
    if problems:
        raise ScoreError(f"{drafter_dir}: the drafter does not fit the target: its {'; its '.join(problems)}")
    draft_ids = torch.arange(dcfg.draft_vocab_size) + drafter.d2t
    attention, oov = objective_options(cfg, device)
    objective = place(TTTObjective(drafter, head, cfg, attention, oov), device)
    objective.set_vocab(draft_ids.to(device))
    return objective


def check_states(objective: TTTObjective, data_dir: Path, run_id: str, item: data.Item, drafter_dir: Path) -> None:
    """ScoreError unless the run's stored states have the widths the drafter reads."""
    found = sample_header(sample_path(data_dir, run_id, item.sample_id))
    if found is None:
        raise ScoreError(
            f"run {run_id}: sample {item.sample_id} is marked extracted but its stored states are not there"
        )
    shapes, metadata = found
    cfg = objective.drafter.cfg
    target_hidden = objective.target_head.shape[1]
    hidden, stored_aux = state_widths(shapes)
    if hidden is not None and hidden != target_hidden:
        raise ScoreError(
            f"run {run_id}: its stored states are {hidden} wide but the target's hidden size is "
            f"{target_hidden}: a run of another target"
        )
    aux = cfg.num_aux_hidden_states * cfg.target_hidden_size
    if stored_aux != aux:
        raise ScoreError(
            f"{drafter_dir}: the drafter reads {cfg.num_aux_hidden_states} aux states of {cfg.target_hidden_size} "
            f"({aux} wide) but run {run_id} stored {stored_aux}-wide aux states"
        )
    # a drafter trained on other layers still scores, but on features it was not trained on
    declared = ckpt.declared_layers(drafter_dir)
    stored = json.loads(metadata["aux_layer_ids"]) if metadata.get("aux_layer_ids") else None
    if declared is not None and stored is not None and declared != [int(i) for i in stored]:
        log.warning(
            "%s: the drafter declares the inputs of layers %s but run %s stored the inputs of layers %s",
            drafter_dir,
            declared,
            run_id,
            stored,
        )


def parse_drafters(values: list[str], parser: argparse.ArgumentParser) -> dict[str, Path]:
    drafters: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            parser.error(f"--drafter takes NAME=DIR, got {value!r}")
        if name in drafters:
            parser.error(f"--drafter name {name!r} given twice")
        drafters[name] = Path(folder)
    return drafters


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eaglet score", description="Held-out loss and per-position accuracy of saved EAGLE-3 drafters."
    )
    p.add_argument("--run", required=True, help="the run whose held-out samples score the drafters")
    p.add_argument(
        "--drafter",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="a drafter folder in SGLang's format, under the name its figures get; repeat for more",
    )
    p.add_argument("--model", help="target model directory (default: the run's model_dir, else EAGLET_MODEL)")
    p.add_argument("--out", type=Path, help="also write the JSON to this file")
    p.add_argument("--ttt-steps", type=int, default=DEFAULTS.ttt_steps, help="draft positions scored")
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        default=DEFAULTS.tokens_per_batch,
        help="padded tokens per held-out batch (the figures are means over batches, as in training)",
    )
    p.add_argument("--max-len", type=int, default=DEFAULTS.max_len, help="longer samples are cut to this")
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=DEFAULTS.heldout_fraction,
        help="the training's held-out fraction: which samples are held out",
    )
    p.add_argument(
        "--oov-mask",
        choices=("auto", "on", "off"),
        default=DEFAULTS.oov_mask,
        help="as the trainer's flag: auto is on on GPU",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    drafters = parse_drafters(args.drafter, parser)
    setup_logging()
    settings = Settings()
    redis = connect(settings.redis_url)
    state = RunState(redis, args.run)
    known = state.exists()
    if not known:
        log.warning("run %s: not in Redis; scoring the held-out samples whose states are stored", args.run)
    model = args.model or (state.meta().model_dir if known else None) or settings.model
    target_dir = resolve_model_dir(model, settings.model_cache_dir)
    out = {}
    try:
        for name, folder in drafters.items():
            out[name] = score_drafter(
                data_dir=settings.data_dir,
                run_id=args.run,
                target_dir=target_dir,
                drafter_dir=folder,
                ttt_steps=args.ttt_steps,
                tokens_per_batch=args.tokens_per_batch,
                max_len=args.max_len,
                heldout_fraction=args.heldout_fraction,
                oov_mask=args.oov_mask,
                redis=redis if known else None,
            )
            log.info("%s: held-out loss %s, accuracy %s", name, out[name]["heldout_loss"], out[name]["heldout_acc"])
    except (ScoreError, ckpt.CheckpointError, ValueError) as e:
        log.error("%s", e)
        return 1
    text = json.dumps(out, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
