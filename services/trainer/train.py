"""The training loop: EAGLE-3 training-time test on stored hidden states, any number of processes (torchrun/DDP).

Progress goes to the run's ``TrainProgress`` record (the Redis hash ``RunKeys(run).train``, rank 0 only)::

    step, total_steps, epoch, epochs
    loss            weighted TTT loss of the last step (forward KL, steps weighted 0.8^i)
    acc             per unroll step, the share of loss positions where the drafter's top token is the target's
                    top token; a position whose target top token is outside the draft vocabulary counts as a miss
                    (as SpecForge counts; seen only with the OOV mask on, else the top over the draft vocabulary)
    lr, tokens_per_s (all ranks, padding excluded), eta_s
    last_checkpoint path of the newest trainer checkpoint; drafter_dir once written
    heldout_loss, heldout_acc   on the held-out split, at each checkpoint and at the end
    train_samples, heldout_samples, draft_vocab_size, ttt_steps, world_size, device
    started_at, updated_at, finished_at (unix s)

The same loss, accuracy and tokens/s of each report also go to the run's capped training series (by step, for the
live page's charts: shared/series.py).
Whether the trainer waits, trains, evaluates, is done or failed (and why) is the run's stage, set by the entry point.
Every step's loss, accuracy, learning rate and gradient norm are also appended to
``<run>/checkpoints/metrics.jsonl`` (the loss curve) and, with throughput and held-out figures, written as
TensorBoard curves under ``<run>/tensorboard/`` (``curves``). With several processes every figure is the global
batch's, the same as one process would report on it."""

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from redis import Redis
from redis.client import NEVER_DECODE
from torch import nn

from eaglet.services.trainer import checkpoint as ckpt
from eaglet.services.trainer import data, memory, onpolicy, selection
from eaglet.services.trainer.compiled import compile_objective, compile_on
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.curves import curves_dir
from eaglet.services.trainer.dflash import DFlashConfig, DFlashDrafter
from eaglet.services.trainer.dflash_objective import DFlashObjective
from eaglet.services.trainer.distributed import Dist, distribute, everywhere
from eaglet.services.trainer.model import Drafter, DrafterConfig, attention_shape, drafter_config, rope_theta
from eaglet.services.trainer.objective import (
    TTTObjective,
    heldout_figures,
    objective_options,
    place,
    states_dtype,
)
from eaglet.services.trainer.optimizer import build_optimizer
from eaglet.services.trainer.preemption import Preempted, StopOnSignal
from eaglet.services.trainer.reporter import Reporter
from eaglet.services.trainer.unreadable import UnreadableSamples
from eaglet.services.trainer.vocab import build_vocab, count_tokens
from eaglet.shared.keys import RunKeys
from eaglet.shared.records import RunMeta, TrainProgress
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.series import TrainPoint
from eaglet.shared.store import StoreError, checkpoints_dir, drafter_dir, read_metadata, sample_path, samples_dir
from eaglet.shared.target import model_config
from eaglet.shared.targettensors import load_target_tensors

log = logging.getLogger(__name__)


def build_drafter(
    target_dir: Path, draft_ids: torch.Tensor, cfg: TrainConfig, layers: list[int], shape: DrafterConfig | None = None
) -> tuple[Drafter, torch.Tensor]:
    """A fresh drafter shaped after the target (``model.drafter_config``) reading the states of ``layers``, or as
    ``shape`` says (a resumed run keeps its checkpoint's shape), and the target's LM head [V, H] for the loss."""
    tcfg = model_config(target_dir)
    tensors = load_target_tensors(target_dir)
    if shape is None:
        shape = drafter_config(
            tcfg.get("text_config", tcfg), vocab_size=tensors["embed"].shape[0], draft_vocab_size=len(draft_ids),
            num_aux_hidden_states=len(layers), head_dim=cfg.draft_head_dim, kv_heads=cfg.draft_kv_heads,
            norm_before_fc=cfg.norm_before_fc,
        )  # fmt: skip
    model = Drafter(shape, tensors["embed"].float())
    model.set_vocab(draft_ids)
    if cfg.init_from_target:
        with torch.no_grad():
            model.lm_head.weight.copy_(tensors["lm_head"][draft_ids].float())
            model.norm.weight.copy_(tensors["norm"].float())
    return model, tensors["lm_head"].float()


def build_dflash(
    target_dir: Path, cfg: TrainConfig, layers: list[int], mask_token_id: int, shape: DFlashConfig | None = None
) -> tuple[DFlashDrafter, torch.Tensor]:
    """A fresh DFlash drafter of ``cfg.dflash_layers`` layers shaped after the target (its attention shape, as the
    EAGLE-3 drafter's) reading the states of every captured layer in ``layers``, or as ``shape`` says (a resumed
    run's), and the target's LM head [V, H]: the drafter's own."""
    tcfg = model_config(target_dir)
    text = tcfg.get("text_config", tcfg)
    tensors = load_target_tensors(target_dir)
    if shape is None:
        heads, kv, head_dim = attention_shape(text, cfg.draft_head_dim, cfg.draft_kv_heads)
        shape = DFlashConfig(
            hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
            num_hidden_layers=cfg.dflash_layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
            vocab_size=tensors["embed"].shape[0], num_target_layers=text["num_hidden_layers"],
            target_layer_ids=[i - 1 for i in layers],  # eaglet's ids are layer inputs; DFlash's, layer outputs
            block_size=cfg.block_size, mask_token_id=mask_token_id, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(text), max_position_embeddings=text.get("max_position_embeddings", 4096),
        )  # fmt: skip
    drafter = DFlashDrafter(shape, tensors["embed"].float())
    if cfg.init_from_target:  # the target's LM head reads states its final norm scaled: start the drafter's there
        with torch.no_grad():
            drafter.norm.weight.copy_(tensors["norm"].float())
    return drafter, tensors["lm_head"].float()


def run_method(cfg: TrainConfig, meta: RunMeta) -> str:
    """The drafter method to train: the trainer's option, or for ``auto`` the run's own (eagle3 when it names none)."""
    if cfg.method != "auto":
        return cfg.method
    return meta.options.method if meta.options is not None else "eagle3"


def captured_layers(meta: RunMeta, data_dir: Path, run_id: str, items: list[data.Item]) -> list[int]:
    """The layers the run's stored states were captured at: the run's record, set by its first dump; for a run
    stored before that record existed, the first readable stored sample's own metadata (an unreadable one is the
    loader's to report). RuntimeError when neither says."""
    if meta.captured_layers:
        return meta.captured_layers
    for item in items:
        try:
            raw = read_metadata(sample_path(data_dir, run_id, item.sample_id)).get("aux_layer_ids")
        except StoreError:
            continue
        if raw:
            return [int(i) for i in json.loads(raw)]
        break
    raise RuntimeError(
        f"run {run_id}: the layers its hidden states were captured at are not known (neither the run nor its "
        "stored samples record them): the drafter's config would tell the engines to feed it other layers"
    )


def lr_lambda(total: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def read_done(redis: Redis, run_id: str, total: int) -> list[int]:
    bitmap = redis.execute_command("GET", RunKeys(run_id).done, **{NEVER_DECODE: []})
    return data.done_indexes(bitmap, total)


@dataclass(slots=True)
class Session:
    """One training in progress: its run, its model and optimizer, and where it stands."""

    cfg: TrainConfig
    env: Dist
    run_id: str
    data_dir: Path
    target_dir: Path
    folder: Path  # the run's checkpoints
    drafter_out: Path  # where the drafter is written
    train_items: list[data.Item]
    held_items: list[data.Item]
    aux_layer_ids: list[int]  # the layers the stored states were captured at
    draft_ids: torch.Tensor  # [Vd] target ids of the draft vocabulary
    objective: TTTObjective | DFlashObjective
    model: nn.Module  # the objective, wrapped in DDP across processes
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    rep: Reporter
    unreadable: UnreadableSamples  # the samples whose stored files could not be read, against the allowance
    total: int  # optimizer steps of the whole training
    stop: StopOnSignal = field(default_factory=StopOnSignal)  # a SIGTERM asks for a checkpoint and the end
    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of the epoch done: where a resumed epoch starts
    last: dict = field(default_factory=dict)  # loss and per-step accuracy of the newest step
    saved_step: int | None = None  # the step of the newest checkpoint (with its held-out pass) this process made
    # the figures of the steps not yet read back from the device: (step, lr, [loss, step losses, accuracies, tokens],
    # gradient norm); read in one go at the next report or checkpoint, so no step waits for the GPU to finish
    pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    window_tokens: int = 0  # tokens (all ranks) since the last report
    window_start: float = field(default_factory=time.time)

    @property
    def dtype(self) -> torch.dtype:
        return states_dtype(self.env.device)


def train(
    *, redis: Redis | None, run_id: str, data_dir: Path, target_dir: Path, cfg: TrainConfig, env: Dist,
    out_dir: Path | None = None, on_step: Callable[[Session, data.Batch], None] | None = None,
) -> dict:  # fmt: skip
    """Trains the run's drafter and writes ``<run>/drafter/``; resumes from the newest checkpoint if any.
    Returns the final figures (also in the Redis hash, when given one).

    ``out_dir``: another drafter from the same extraction (a recipe compared with the run's own): its checkpoints,
    curves and drafter go to ``out_dir/{checkpoints,curves,drafter}`` and the run's own stay as they are.

    ``on_step``: called after every optimizer step with the session and its batch (the speed benches time the steps
    by it); it must not read the step's figures back from the device, or the host waits on every step.

    A SIGTERM ends it at the next step with a checkpoint: ``Preempted`` (``preemption.py``)."""
    s = start(redis, run_id, Path(data_dir), Path(target_dir), cfg, env, out_dir)
    try:
        with s.stop:
            while s.step < s.total:
                train_epoch(s, on_step)
                if cfg.keep_epochs and s.batch == 0 and s.step < s.total:  # an epoch ended, training did not
                    if s.saved_step != s.step:  # not just checkpointed by --checkpoint-every
                        checkpoint(s)
                    keep_epoch(s)
        final = finish(s)
    finally:
        s.rep.close()
    if env.world > 1:
        dist.barrier()
    return final


def start(
    redis: Redis | None, run_id: str, data_dir: Path, target_dir: Path, cfg: TrainConfig, env: Dist,
    out_dir: Path | None = None,
) -> Session:  # fmt: skip
    """The run's split, the drafter (fresh, or as the newest checkpoint left it) and its optimizer."""
    state = RunState(redis, run_id) if redis is not None else None
    meta = state.meta() if state is not None else RunMeta()
    samples = SampleSet(samples_dir(data_dir, run_id))
    indexes = read_done(redis, run_id, len(samples)) if redis is not None else list(range(len(samples)))
    train_items, held_items = data.split_items(samples, indexes, cfg.heldout_fraction)
    if not train_items:
        raise RuntimeError(f"run {run_id}: no extracted samples to train on ({len(indexes)} done)")
    layers = captured_layers(meta, data_dir, run_id, train_items)
    if out_dir is not None:
        folder, curves, drafter_out = (Path(out_dir) / name for name in ("checkpoints", "curves", "drafter"))
    else:
        folder, curves, drafter_out = (f(data_dir, run_id) for f in (checkpoints_dir, curves_dir, drafter_dir))
    folder.mkdir(parents=True, exist_ok=True)
    saved = ckpt.load_latest_state(folder)
    method = run_method(cfg, meta)
    was = saved.get("method", "eagle3") if saved is not None else method
    if was != method:
        raise ValueError(f"run {run_id}: its checkpoints in {folder} are of a {was} drafter, resumed as {method}: "
                         f"resume with --method {was}, or train into a folder of its own")  # fmt: skip
    objective: TTTObjective | DFlashObjective
    if method == "dflash":
        draft_ids, objective = dflash_objective(
            samples, train_items, target_dir, cfg, env, layers, saved, data_dir, run_id
        )
    else:
        previous = previous_drafter(cfg, target_dir, layers)
        if saved is not None:  # resumed: the checkpoint's vocabulary and shape
            draft_ids, shape = saved["draft_ids"], DrafterConfig(**saved["drafter_config"])
        elif previous is not None:  # an on-policy round: the previous drafter's
            draft_ids, shape = previous.draft_to_target(torch.arange(previous.cfg.draft_vocab_size)), previous.cfg
        else:
            draft_ids, shape = draft_vocab(samples, train_items, target_dir, cfg, env), None
        objective = make_objective(target_dir, draft_ids, cfg, env, layers, shape, previous)
        check_memory(objective, cfg, env, data.longest_row(train_items, cfg.tokens_per_batch, cfg.max_len))
    per_epoch = len(epoch_batches(train_items, cfg, env, 0))
    if per_epoch == 0:
        raise RuntimeError(f"run {run_id}: {len(train_items)} samples make no batch for {env.world} processes")
    total = cfg.max_steps if cfg.max_steps > 0 else per_epoch * cfg.epochs
    lr = cfg.dflash_lr if method == "dflash" else cfg.lr
    opt = build_optimizer(cfg.optimizer, objective.drafter, lr, cfg.weight_decay)
    warmup = max(1, int(cfg.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup, cfg.min_lr_ratio))
    s = Session(
        cfg=cfg, env=env, run_id=run_id, data_dir=data_dir, target_dir=target_dir, folder=folder,
        drafter_out=drafter_out,
        train_items=train_items, held_items=held_items, aux_layer_ids=layers,
        draft_ids=draft_ids, objective=objective, model=distribute(objective, env), opt=opt, sched=sched,
        rep=Reporter(state, folder, curves, env.main), total=total,
        unreadable=UnreadableSamples(run_id, state, len(train_items) + len(held_items), cfg.max_unreadable),
    )  # fmt: skip
    if saved is not None:
        resume(s, saved)
    announce(s, per_epoch)
    return s


def draft_vocab(
    samples: SampleSet, items: list[data.Item], target_dir: Path, cfg: TrainConfig, env: Dist
) -> torch.Tensor:
    """The draft vocabulary [Vd]: the target ids most frequent in the training split's loss positions. Rank 0
    counts them and sends the result: every sample is read once, not once per process."""
    vocab: list[torch.Tensor | None] = [None]
    if env.main:
        tcfg = model_config(target_dir)
        vocab_size = int(tcfg.get("text_config", tcfg)["vocab_size"])
        counts = count_tokens(((samples[it.index].input_ids, samples[it.index].loss_mask) for it in items), vocab_size)
        vocab[0] = build_vocab(counts, min(cfg.draft_vocab_size, vocab_size), always=eos_ids(target_dir))
    if env.world > 1:
        dist.broadcast_object_list(vocab, src=0)
    assert vocab[0] is not None  # rank 0 built it; the broadcast gave it to the others
    return vocab[0]


def dflash_objective(
    samples: SampleSet, items: list[data.Item], target_dir: Path, cfg: TrainConfig, env: Dist, layers: list[int],
    saved: dict | None, data_dir: Path, run_id: str,
) -> tuple[torch.Tensor, DFlashObjective]:  # fmt: skip
    """(the whole target vocabulary [V], the DFlash objective around a fresh drafter or the checkpoint's)."""
    shape = DFlashConfig(**saved["drafter_config"]) if saved is not None else None
    mask_id = shape.mask_token_id if shape is not None else mask_token(samples, items, target_dir, env)
    torch.manual_seed(cfg.seed)
    drafter, target_head = build_dflash(target_dir, cfg, layers, mask_id, shape)
    if saved is None and cfg.dflash_scale_inputs:  # resumed: the checkpoint holds the scale it trained with
        drafter.input_scale = 1 / feature_rms(data_dir, run_id, items, env)
    if cfg.compile != "off":
        log.info("DFlash drafters train eager: --compile applies to EAGLE-3")
    objective = DFlashObjective(drafter, target_head, cfg)
    dtype = states_dtype(env.device)  # the frozen target tensors in the states' dtype, as the EAGLE-3 objective's
    objective.target_head = objective.target_head.to(dtype)
    drafter.embed_tokens = drafter.embed_tokens.to(dtype)
    return torch.arange(drafter.cfg.vocab_size), objective.to(env.device)


SCALE_TOKENS = 65_536
"""Tokens of the first training samples that ``feature_rms`` reads: enough for a steady RMS of every feature."""
SCALE_CHUNK = 1024
"""Rows squared at once there (at Kimi-K2.5's five layers of 7,168: 147 MB in float)."""


def feature_rms(data_dir: Path, run_id: str, items: list[data.Item], env: Dist) -> torch.Tensor:
    """The RMS of every feature of the stored auxiliary states [K * H] over the first ``SCALE_TOKENS`` tokens of the
    training split, each document's first token left out (its activations, 1e4 and more in some targets, are no
    feature's scale). Rank 0 reads and sends it; a sample it cannot read is left out here (training reports it)."""
    out: list[torch.Tensor | None] = [None]
    if env.main:
        sums, count = None, 0
        for it in items:
            if count >= SCALE_TOKENS:
                break
            try:  # in the states' training dtype, as a batch holds them: a sample's float copy would be twice that
                states = data.load_sample(sample_path(data_dir, run_id, it.sample_id), torch.bfloat16)
            except StoreError:
                continue
            aux = states["aux_hidden_states"][1:]
            if sums is None:
                sums = torch.zeros(aux.shape[1], dtype=torch.float64)
            for rows in aux.split(SCALE_CHUNK):  # bounded: a chunk in float at a time
                sums += rows.float().pow(2).sum(0, dtype=torch.float64)
            count += len(aux)
        if sums is None or count == 0:
            raise RuntimeError("--dflash-scale-inputs: no training sample could be read to scale the inputs by")
        out[0] = (sums / count).sqrt().float().clamp(min=1e-6)
    if env.world > 1:
        dist.broadcast_object_list(out, src=0)
    assert out[0] is not None  # rank 0 computed it; the broadcast gave it to the others
    return out[0]


def mask_token(samples: SampleSet, items: list[data.Item], target_dir: Path, env: Dist) -> int:
    """The token a DFlash block's drafted positions hold (the engine embeds it with the target's embedding, so it
    must be a row of it): the tokenizer's own mask token when it has one, else the highest id that no training
    sample holds, so no real token's embedding is read as "to be drafted". Rank 0 counts and sends the choice."""
    choice = [0]
    if env.main:
        tcfg = model_config(target_dir)
        vocab_size = int(tcfg.get("text_config", tcfg)["vocab_size"])
        own = tokenizer_mask_id(target_dir)
        if own is not None and own < vocab_size:
            choice[0] = own
        else:
            rows = (samples[it.index].input_ids for it in items)
            counts = count_tokens(((ids, np.ones(len(ids), dtype=bool)) for ids in rows), vocab_size)
            unused = np.flatnonzero(counts == 0)
            if len(unused) == 0:
                raise RuntimeError("every token of the vocabulary occurs in the training split: no row of the "
                                   "target's embedding is free to be DFlash's mask token")  # fmt: skip
            choice[0] = int(unused[-1])
    if env.world > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def tokenizer_mask_id(target_dir: Path) -> int | None:
    """The target tokenizer's mask token id, when its tokenizer_config.json names one."""
    path = Path(target_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    mask = config.get("mask_token")
    for tid, added in (config.get("added_tokens_decoder") or {}).items():
        if mask is not None and added.get("content") == mask:
            return int(tid)
    return None


def previous_drafter(cfg: TrainConfig, target_dir: Path, layers: list[int]) -> Drafter | None:
    """An on-policy round's previous drafter (``cfg.onpolicy_from``), checked against the run; None otherwise."""
    if not cfg.onpolicy_from:
        return None
    tcfg = model_config(target_dir)
    hidden = int(tcfg.get("text_config", tcfg)["hidden_size"])
    embed = load_target_tensors(target_dir, ("embed",))["embed"].float()
    return onpolicy.load_previous(Path(cfg.onpolicy_from), embed, hidden, layers)


def make_objective(
    target_dir: Path,
    draft_ids: torch.Tensor,
    cfg: TrainConfig,
    env: Dist,
    layers: list[int],
    shape: DrafterConfig | None,
    previous: Drafter | None = None,
) -> TTTObjective:
    """The objective around a fresh drafter, or, given an on-policy round's ``previous`` drafter, one that starts
    from its weights and is trained with the loss weights of its chains (``onpolicy.ChainReplay``)."""
    attention, oov = objective_options(cfg, env.device)
    torch.manual_seed(cfg.seed)  # the fresh drafter's weights are the same in every process and rerun
    drafter, target_head = build_drafter(target_dir, draft_ids, cfg, layers, shape)
    replay = None
    if previous is not None:
        drafter.load_state_dict(previous.state_dict())
        replay = onpolicy.ChainReplay(previous, cfg.onpolicy_weight, attention, cfg.loss_chunk)
    objective = place(TTTObjective(drafter, target_head, cfg, attention, oov, replay), env.device)
    objective.set_vocab(draft_ids.to(env.device))
    return compile_objective(objective) if compile_on(cfg, env.device) else objective


def check_memory(objective: TTTObjective, cfg: TrainConfig, env: Dist, longest: int) -> None:
    """Before the first step: MemoryRuleError (saying what would fit) when the memory rule says rows of the run's
    longest batch would not fit the device (``memory.budget_gib``); no check on the CPU without a given budget."""
    budget = memory.budget_gib(cfg, env.device)
    if budget is not None:
        need = memory.check_fits(objective.drafter.cfg, cfg, longest, budget, env.world)
        log.info("memory rule: rows of up to %d tokens need about %.1f GiB of the %.1f GiB planned for",
                 longest, need.total_gib, budget)  # fmt: skip


def epoch_batches(items: list[data.Item], cfg: TrainConfig, env: Dist, epoch: int) -> list[list[data.Item]]:
    """This rank's batches of ``epoch``: the same on every rerun, so a resumed epoch skips to its place."""
    return data.shard(data.make_batches(items, cfg.tokens_per_batch, cfg.seed, epoch), env.rank, env.world)


def resume(s: Session, saved: dict) -> None:
    was = saved.get("train_config", {}).get("optimizer", "adamw")
    if was != s.cfg.optimizer:
        raise ValueError(f"run {s.run_id}: its checkpoint was trained with --optimizer {was}, resumed with another "
                         f"--optimizer ({s.cfg.optimizer}): resume with {was}, or train into a new folder")  # fmt: skip
    was_from, now_from = saved.get("train_config", {}).get("onpolicy_from", ""), s.cfg.onpolicy_from
    if was_from != now_from:  # a round would otherwise resume the training it should start from, or the reverse
        was, now = (f"an on-policy round from {f}" if f else "a fresh drafter's training" for f in (was_from, now_from))
        raise ValueError(f"run {s.run_id}: its checkpoints in {s.folder} are of {was}, resumed as {now}: train it "
                         "into a folder of its own (train(out_dir=...), ablate.py --out) or resume with the same "
                         "--onpolicy-from")  # fmt: skip
    weights = saved["model"]
    if isinstance(s.objective.drafter, DFlashDrafter) and "input_scale" not in weights:
        # a DFlash checkpoint from before fc's inputs could be scaled trained them unscaled
        weights = {**weights, "input_scale": torch.ones_like(s.objective.drafter.input_scale)}
    s.objective.drafter.load_state_dict(weights)
    s.opt.load_state_dict(saved["optimizer"])
    s.sched.load_state_dict(saved["scheduler"])
    s.step, s.epoch, s.batch = saved["step"], saved["epoch"], saved["batch"]
    ckpt.set_rng_state(saved["rng"])


def announce(s: Session, per_epoch: int) -> None:
    cfg, env = s.cfg, s.env
    s.rep.set(TrainProgress(
        step=s.step, total_steps=s.total, epoch=s.epoch, epochs=cfg.epochs, started_at=time.time(),
        train_samples=len(s.train_items), heldout_samples=len(s.held_items), draft_vocab_size=len(s.draft_ids),
        ttt_steps=s.objective.positions, world_size=env.world, device=str(env.device),
    ))  # fmt: skip
    log.info(
        "run %s: training %d steps (%d a epoch), %d train / %d held-out samples, draft vocab %d, %d draft positions, "
        "%d process(es) on %s, attention %s, %s",
        s.run_id, s.total, per_epoch, len(s.train_items), len(s.held_items), len(s.draft_ids),
        s.objective.positions, env.world, env.device, s.objective.attention,
        "compiled" if compile_on(cfg, env.device) else "eager",
    )  # fmt: skip
    s.rep.start_bar(s.total, s.step)


def train_epoch(s: Session, on_step: Callable[[Session, data.Batch], None] | None = None) -> None:
    """The rest of the current epoch, or of the training if it ends first; a checkpoint every ``checkpoint_every``."""
    batches = epoch_batches(s.train_items, s.cfg, s.env, s.epoch)
    batch_set = s.objective.batch_set(batches, s.data_dir, s.run_id, s.dtype, s.cfg.max_len)
    cuda = s.env.device.type == "cuda"
    for batch in data.on_device(data.loader(batch_set, s.batch, s.cfg.loader_workers, pin=cuda), s.env.device):
        if s.step >= s.total:
            return
        s.unreadable.note(batch)
        # processes step in lock-step: a batch none of whose samples could be read is skipped by all of them, and
        # a stop asked of any of them stops all of them before the same step
        readable, go_on = everywhere([not data.is_empty(batch), not s.stop.requested], s.env)
        if not go_on:
            stop_here(s)
        if not readable:
            s.batch += 1
            continue
        train_step(s, batch)
        if on_step is not None:
            on_step(s, batch)
        if s.step % s.cfg.checkpoint_every == 0 and s.step < s.total:
            checkpoint(s)
    s.epoch, s.batch = s.epoch + 1, 0


def train_step(s: Session, b: data.Batch) -> None:
    """One optimizer step on one batch (on the device), recorded in metrics.jsonl and reported every ``log_every``
    steps. Its figures stay on the device until then: the host queues the next step while this one runs."""
    env = s.env
    s.objective.noise_seed = (s.cfg.seed << 32) + s.step * env.world + env.rank  # the step's own, in every run
    # DDP averages the processes' gradients, and the global loss is the sum of their shares
    loss, losses, accs, gnorm = optimizer_step(
        s.model,
        s.objective.drafter,
        s.opt,
        s.objective.inputs(b),
        s.cfg.grad_clip,
        bf16=env.device.type == "cuda",
        scale=env.world,
    )
    lr = float(s.sched.get_last_lr()[0])  # the rate this step used
    s.sched.step()
    s.step, s.batch = s.step + 1, s.batch + 1
    s.pending.append((s.step, lr, torch.cat([loss.detach()[None], losses, accs, b["tokens"].float()[None]]), gnorm))
    if s.step % s.cfg.log_every == 0 or s.step == s.total:
        report(s)


def optimizer_step(model: nn.Module, drafter: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, grad_clip: float,
                   *, bf16: bool, scale: float = 1.0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One optimizer step of ``model`` (the objective, or its DDP wrapper) on a batch's objective inputs, under bf16
    autocast when ``bf16``: (loss, per-step losses, per-step accuracies, the gradients' norm before clipping to
    ``grad_clip``), left on the device. The previous step's gradients are dropped before the forward pass: kept
    through it they would add 4 bytes a parameter to its peak (3.6 GiB at Kimi-K2.5's shape)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(inputs[0].device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, losses, accs = model(*inputs)
    (loss * scale).backward()
    gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    opt.step()
    return loss, losses, accs, gnorm


def read_figures(s: Session) -> None:
    """The pending steps' figures read back from the device in one go (one wait for the GPU, one all-reduce across
    processes: shares summed, the global batch's figures) and recorded step by step."""
    if not s.pending:
        return
    figures = torch.stack([f for _, _, f, _ in s.pending])
    if s.env.world > 1:
        dist.all_reduce(figures)
    norms = torch.stack([g for *_, g in s.pending]).tolist()  # the same on every process: not summed
    k = s.objective.positions
    for (step, lr, _, _), row, gnorm in zip(s.pending, figures.tolist(), norms, strict=True):
        total_loss, *per_step, tokens = row
        s.window_tokens += int(tokens)
        s.last = {"loss": total_loss, "acc": [round(a, 4) for a in per_step[k:]]}
        s.rep.record({"step": step, **s.last, "step_losses": per_step[:k], "grad_norm": gnorm, "lr": lr})
    s.pending.clear()
    s.rep.step(s.step, f"loss {s.last['loss']:.3f} acc0 {s.last['acc'][0]:.2f}")


def report(s: Session) -> None:
    """Progress, with throughput and time left measured since the previous report."""
    read_figures(s)
    now = time.time()
    elapsed = max(now - s.window_start, 1e-9)
    tokens_per_s = s.window_tokens / elapsed
    eta = (s.total - s.step) / max(s.cfg.log_every / elapsed, 1e-9)
    lr = s.sched.get_last_lr()[0]
    figures = TrainProgress(
        step=s.step, epoch=s.epoch, lr=lr, tokens_per_s=round(tokens_per_s, 1), eta_s=round(eta), **s.last
    )
    s.rep.set(figures)
    point = TrainPoint(step=s.step, t=now, loss=s.last["loss"], acc=s.last["acc"], tokens_per_s=figures.tokens_per_s)
    s.rep.point(point, last=s.step == s.total)
    s.rep.throughput(s.step, figures.tokens_per_s)
    log.info(
        "run %s: step %d/%d loss %.4f acc %s %.0f tok/s",
        s.run_id, s.step, s.total, s.last["loss"], s.last["acc"], tokens_per_s,
    )  # fmt: skip
    s.window_tokens, s.window_start = 0, now


def checkpoint(s: Session) -> dict:
    """Rank 0 saves a checkpoint, then every process evaluates its share of the held-out split. Returns the
    checkpoint's path (rank 0) and the held-out figures."""
    read_figures(s)  # every step the checkpoint holds is in metrics.jsonl before it
    path = save(s) if s.env.main else None
    figures = heldout(s)
    s.rep.heldout(s.step, figures)
    s.saved_step = s.step
    if path is not None and figures:  # the export carries its own held-out figures: the served prediction's input
        (s.drafter_out / ckpt.HELDOUT).write_text(json.dumps({"step": s.step, **figures}))
    return {"last_checkpoint": str(path), **figures} if path is not None else figures


def stop_here(s: Session) -> None:
    """A stop asked between steps: the steps done so far saved as a checkpoint (no held-out pass: a stop is
    usually given a few seconds), then ``Preempted``."""
    read_figures(s)
    path = save(s) if s.env.main else None
    if s.env.world > 1:
        dist.barrier()  # no process ends while rank 0 still writes
    where = f"; {path} resumes it" if path is not None else ""
    raise Preempted(f"run {s.run_id}: stopped on request at step {s.step} of {s.total}{where}")


def save(s: Session) -> Path:
    """A resumable checkpoint, and the drafter as SGLang and vLLM load it; returns the checkpoint's path."""
    drafter = s.objective.drafter
    blob = {
        "model": drafter.state_dict(), "optimizer": s.opt.state_dict(), "scheduler": s.sched.state_dict(),
        "step": s.step, "epoch": s.epoch, "batch": s.batch, "rng": ckpt.rng_state(), "draft_ids": s.draft_ids.cpu(),
        "train_config": asdict(s.cfg), "drafter_config": drafter.cfg.to_dict(),
        "method": "dflash" if isinstance(drafter, DFlashDrafter) else "eagle3",
    }  # fmt: skip
    path = ckpt.save_state(s.folder, s.step, blob, s.cfg.keep_checkpoints)
    target_config = model_config(s.target_dir)
    if isinstance(drafter, DFlashDrafter):
        out = ckpt.save_dflash(s.drafter_out, drafter, target_config, s.dtype)
    else:
        out = ckpt.save_drafter(s.drafter_out, drafter, target_config, s.aux_layer_ids, s.dtype)
    s.rep.set(TrainProgress(last_checkpoint=str(path), drafter_dir=str(out)))
    return path


def finish(s: Session) -> dict:
    """The last checkpoint and held-out figures; returns the final figures (rank 0; the others: {})."""
    final = {"step": s.step, **s.last, **checkpoint(s)}
    if s.cfg.keep_epochs:
        keep_epoch(s)
    s.rep.set(TrainProgress(**final, finished_at=time.time()))
    figures = {k: final.get(k) for k in ("heldout_loss", "heldout_acc")}
    log.info("run %s: training done at step %d, held-out %s", s.run_id, s.step, figures)
    return final if s.env.main else {}


def keep_epoch(s: Session) -> None:
    """Rank 0 keeps the drafter just exported, with its held-out figures, as the candidate of the epoch that ended
    (or the part of one training ended in), for ``--select-by``."""
    if s.env.main:
        epoch = s.epoch if s.batch == 0 else s.epoch + 1
        selection.keep(selection.epochs_dir(s.drafter_out.parent), epoch, s.drafter_out)


def heldout(s: Session) -> dict:
    """Mean TTT loss and per-step accuracy over the held-out batches, each process evaluating every world-th one
    (the objective alone, outside DDP: no lock-step needed)."""
    if not s.held_items:
        return {}
    figures = heldout_figures(
        s.objective, s.held_items, data_dir=s.data_dir, run_id=s.run_id, tokens_per_batch=s.cfg.tokens_per_batch,
        max_len=s.cfg.max_len, device=s.env.device, rank=s.env.rank, world=s.env.world, unreadable=s.unreadable,
    )  # fmt: skip
    return {k: figures[k] for k in ("heldout_loss", "heldout_acc")}


def eos_ids(target_dir: Path) -> list[int]:
    """End-of-turn ids: the drafter must be able to propose the end of an answer."""
    cfg = model_config(target_dir)
    eos = cfg.get("eos_token_id")
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return [int(i) for i in ids]
