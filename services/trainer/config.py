"""The trainer's options: one dataclass, checked when it is built. Each field is a flag of
``eaglet.services.trainer.main``."""

from dataclasses import dataclass
from typing import Literal, get_args

from eaglet.services.trainer.optimizer import Optimizer

Attention = Literal["auto", "math", "flex"]
OovMask = Literal["auto", "on", "off"]
Compile = Literal["auto", "on", "off"]
Loss = Literal["kl", "lk-alpha", "lk-lambda"]
LossMaskAlign = Literal["predicted", "position"]
TopkTail = Literal["bucket", "uniform"]
Method = Literal["auto", "eagle3", "dflash"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The trainer's options. Each field is a flag of ``eaglet.services.trainer.main`` (``ttt_steps``:
    ``--ttt-steps``), its docstring the flag's help."""

    method: Method = "auto"
    """eagle3: an EAGLE-3 drafter (a chain, one layer) | dflash: a DFlash drafter (a block drafted in one pass,
    ``dflash_layers`` layers, on every layer the run captured) | auto: the run's own method (``--method`` at
    ingest), eagle3 for a run that names none."""
    dflash_layers: int = 5
    """A DFlash drafter's layers (the published DFlash drafters': 5)."""
    block_size: int = 16
    """A DFlash drafter's block: the verified token and block_size - 1 drafted ones (SGLang drafts and verifies
    the whole block)."""
    dflash_anchors: int = 512
    """Most blocks trained per batch (each block_size tokens through the drafter), drawn among the loss positions."""
    dflash_decay: float = 7.0
    """A DFlash block position j's loss weight is exp(-(j - 1) / dflash_decay) (the DFlash paper's 7 for blocks of
    16); 0: all weighted 1."""
    dflash_scale_inputs: bool = False
    """Train fc on the target's states divided, feature by feature, by their RMS over the first training samples
    (each document's first token left out), folded back into fc's columns on export, so the served drafter is
    SGLang's as it is. The target's states are far apart in scale (SmolLM2: a feature's RMS reaches 33x the median
    at layer 2, 470x at layer 28); on the raw states fc's outlier columns take Adam steps as large as the rest."""
    dflash_lr: float = 6e-4
    """A DFlash drafter's peak learning rate (``lr`` is EAGLE-3's): the DFlash paper's 6e-4. On SmolLM2's states
    (its first token's activations reach 2.5e4), at 3e-3 the gradient reaching fc, the only way in for the target's
    context, fell from 4.7e3 to 0.1-0.5 within 75 steps, where at 6e-4 it stayed at 10-35; a 16-sample run at 3e-3
    ended at unigram accuracy (0.06 at every block position)."""
    ttt_steps: int = 7
    """Unrolled training-time-test steps; the drafter is trained to draft this many tokens in a chain."""
    step_weight: float = 0.8
    """Loss weight of step i is step_weight ** i."""
    loss: Loss = "kl"
    """kl: forward KL(target || drafter) over the draft vocabulary | lk-alpha: minus the log of the expected
    acceptance sum_v min(p_v, q_v) (p: the target's probabilities over its whole vocabulary, on the draft
    vocabulary's tokens; q: the drafter's) | lk-lambda: w KL + (1 - w) (1 - acceptance), w = lk_kl_scale *
    exp(-lk_kl_decay * acceptance): SpecForge's acceptance-aware LK losses, per step, then weighted as above."""
    loss_mask_align: LossMaskAlign = "predicted"
    """Which loss-mask entry makes TTT step i at position t a loss position (the step reads token t + 1 + i and
    learns the target's distribution at t + 1 + i, that of token t + 2 + i) | predicted: mask[t + 2 + i], the
    predicted token's own: at every step exactly the answer tokens are predicted | position: mask[t + i], the mask
    moved on with the step as SpecForge moves it, where the target's distribution at t + 1 + i is in the sample: at
    every step the tokens predicted are those two after an answer token, so an answer's first two tokens are never
    predicted and the two after it are (the next turn's first tokens; after a sample's last answer, the target's
    distribution past its last token). The training's held-out figures follow the rule; ``eaglet score`` counts by
    the default one, the same for every drafter it compares."""
    topk_tail: TopkTail = "bucket"
    """A run that stored the target's top-k in place of its final state (the trainer's topk.py): what the KL is told
    of the mass the k entries leave | bucket: only how much of it there is, as one outcome | uniform: that it lies
    evenly on the draft tokens outside the k, so the drafter cannot heap it on a token of its own choosing."""
    lk_kl_scale: float = 1.0
    """lk-lambda's weight of the KL term at zero acceptance."""
    lk_kl_decay: float = 1.0
    """lk-lambda: how fast the KL term's weight falls as the acceptance grows."""
    draft_vocab_size: int = 32768
    """Clipped to the target vocabulary. 32K suits 128K+ vocabularies; 8K-16K for small models."""
    draft_head_dim: int = 0
    """The drafter's head size (0: the target's, or 128 for latent-attention targets such as DeepSeek-V3); with
    another value the drafter has hidden_size / draft_head_dim heads."""
    draft_kv_heads: int = 0
    """The drafter's KV heads (0: the target's, or 8 for latent-attention targets)."""
    epochs: int = 10
    """Full passes over the training split (when max_steps is 0). With ``tokens_per_batch`` 2048 a typical sample
    (1-4K tokens) is about one step per epoch: as many updates per sample as SpecForge's published recipe
    (batch 1 per GPU, 10 epochs). bench/recipe.py: more updates per sample, better held-out accuracy."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: ``epochs`` full passes). The schedule spans the total either way."""
    tokens_per_batch: int = 2048
    """Tokens per batch per process: samples grouped by length are packed end to end into one row under this
    budget, each attending only to itself (a longer one trains alone)."""
    max_len: int = 8192
    """Longer samples are cut to this many tokens."""
    lr: float = 1e-3
    """Peak learning rate, reached after the warmup, then cosine decay. 1e-3 with ``norm_before_fc`` and ``aux_noise``
    is the default recipe: on the head-to-head's data (SmolLM2-135M, 2 epochs, one H200) it accepts 1.18x
    (HumanEval) and 1.24x (held-out prompts) the length of the drafter trained at 1e-4, SpecForge's default
    (results/gpu-headtohead.md, the recipes' table)."""
    optimizer: Optimizer = "adamw"
    """adamw | muon: Muon for the drafter's matrices (fc, its layer's projections), AdamW for the LM head and the
    norms, the Muon update scaled to AdamW's RMS so the same learning rate serves (vLLM speculators' default)."""
    min_lr_ratio: float = 0.0
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_ratio: float = 0.015
    """Share of the steps over which the learning rate rises linearly to lr."""
    weight_decay: float = 0.0
    """Decoupled weight decay (both optimizers)."""
    grad_clip: float = 0.5
    """Gradients are clipped to this global norm."""
    checkpoint_every: int = 500
    """Optimizer steps between checkpoints (each followed by a held-out evaluation)."""
    keep_checkpoints: int = 2
    """Newest trainer checkpoints kept; older ones are deleted."""
    keep_epochs: bool = False
    """Keep each epoch's drafter and its held-out figures in ``<run>/epochs/<epoch>/``, the candidates ``--select-by``
    chooses from (``selection.py``; ``eaglet train --select-by`` other than ``last`` sets it). A checkpoint and a
    held-out pass end every epoch then."""
    heldout_fraction: float = 0.05
    """Share of the samples held out of training (chosen by a hash of the sample id) to measure loss on."""
    seed: int = 0
    """Seeds the fresh drafter's weights and the batch order."""
    loader_workers: int = 2
    """DataLoader processes reading samples ahead of the step (0: read in the loop)."""
    attention: Attention = "auto"
    """math (scores materialized: short samples, CPU) | flex (block-sparse, O(T * steps) memory) | auto: flex on GPU."""
    init_from_target: bool = True
    """Start lm_head from the target's LM head rows of the draft vocabulary and norm from its final norm."""
    norm_before_fc: bool = True
    """An RMSNorm over the concatenated auxiliary states before fc (written to config.json as ``norm_before_fc``,
    which SGLang and vLLM load): the three layers' states differ in scale by orders of magnitude. On the
    head-to-head's data it adds 3 to 9 % to the accept length at either learning rate, decoded by SGLang 0.5.17 on
    an H200; that vLLM loads it was read from vLLM's source when the option was added, not run yet."""
    loss_chunk: int = 4096
    """Loss rows per chunk. A TTT step with more computes its loss chunk by chunk, recomputing each chunk's logits in
    the backward pass instead of keeping rows x draft vocabulary tensors (one more LM-head forward); the target's
    distribution is formed in chunks of as many rows; 0: never chunked."""
    checkpoint_steps: int = 0
    """How many of the unrolled TTT steps recompute their activations in the backward pass instead of keeping them
    (the first ones: by the time the backward pass reaches them the kept steps' activations are freed). Each one
    recomputed saves a step's activations (Kimi-K2.5's shape: 206 KiB a token) for about a third more of its
    compute; ``ttt_steps`` (or more): all of them (Kimi-K2.5's shape: 64K-token rows in about 70 GiB). The memory
    rule's refusal names the fewest that fit."""
    compile: Compile = "off"
    """on | off | auto (on on GPU): torch.compile the drafter's TTT step and the loss chunk (the trainer's
    compiled.py; dynamic shapes: every row length shares the graphs). Meant for where per-kernel overhead dominates
    a step: small drafters. Off by default: its steps ran 1.2x eager's on one H200 at SmolLM2's drafter, but its
    compile (about 25 s with torch's cache filled, 220 s cold) outweighed that over a 2.7 M-token run (README). A
    compile failure is an error; off trains eager."""
    memory_gib: float = 0.0
    """The device memory to plan for, in GiB: before its first step the trainer refuses rows (max_len,
    tokens_per_batch) that the memory rule (the trainer's memory.py) says would not fit, saying what
    would. 0: on a GPU what it has free; on the CPU no check."""
    aux_noise: float = 0.05
    """Uniform noise in [-a, a] added to the auxiliary states while training (never to held-out figures): the
    drafter meets the engine's states, computed in other batches, not the stored ones (speculators' default; 0: off).
    On the head-to-head's data +0.2 to +1.1 % accept length; never worse."""
    onpolicy_from: str = ""
    """An on-policy round (the trainer's onpolicy.py): the previous round's drafter folder (SGLang's format: a run's
    drafter/, or another trainer's), which the training starts from, weights and draft vocabulary, weighting by
    onpolicy_weight each loss position where that drafter's greedy draft chain, replayed frozen on the stored
    states, is first rejected (its draft is not the sample's next token: decoding's own rejection on text the target
    wrote greedily, as ``eaglet regenerate`` writes it). Empty: a fresh drafter, no weights."""
    onpolicy_weight: float = 2.0
    """An on-policy round's loss weight at the positions where the previous round's chains are first rejected (1
    elsewhere; accuracy and held-out figures unweighted)."""
    oov_mask: OovMask = "auto"
    """on | off | auto (on on GPU): drop positions whose target top token (over the full vocabulary) is not in the
    draft vocabulary. Costs a full-vocabulary projection per token; off on CPU for speed."""
    max_unreadable: float = 0.01
    """Share of the run's samples whose stored files may be unreadable (truncated, a bad header): each is skipped,
    named in the log and the run's errors, and counted in its status; one more and the run fails, saying so."""
    log_every: int = 10
    """Optimizer steps between progress reports (Redis hash and log)."""

    def __post_init__(self):
        for name in (
            "ttt_steps", "draft_vocab_size", "tokens_per_batch", "max_len", "checkpoint_every", "keep_checkpoints",
            "log_every", "dflash_layers", "dflash_anchors",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.epochs < 1 and self.max_steps < 1:
            raise ValueError("TrainConfig.epochs or max_steps must be at least 1")
        for name in ("lr", "dflash_lr"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be in (0, 1), got {getattr(self, name)}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"TrainConfig.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        for name in ("draft_head_dim", "draft_kv_heads"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be 0 (the rule) or more, got {getattr(self, name)}")
        if self.loss_chunk < 0:
            raise ValueError(f"TrainConfig.loss_chunk must be 0 (never chunked) or more, got {self.loss_chunk}")
        if self.checkpoint_steps < 0:
            raise ValueError(f"TrainConfig.checkpoint_steps must be 0 (none) or more, got {self.checkpoint_steps}")
        if self.memory_gib < 0:
            raise ValueError(f"TrainConfig.memory_gib must be 0 (the device's) or more, got {self.memory_gib}")
        if self.onpolicy_weight <= 0:
            raise ValueError(f"TrainConfig.onpolicy_weight must be above 0, got {self.onpolicy_weight}")
        if not 0 <= self.max_unreadable <= 1:
            raise ValueError(f"TrainConfig.max_unreadable must be in [0, 1], got {self.max_unreadable}")
        if self.block_size < 2:
            raise ValueError(f"TrainConfig.block_size must be at least 2 (one drafted token), got {self.block_size}")
        if self.dflash_decay < 0:
            raise ValueError(f"TrainConfig.dflash_decay must be 0 (no decay) or more, got {self.dflash_decay}")
        if self.aux_noise < 0:
            raise ValueError(f"TrainConfig.aux_noise must be 0 (off) or more, got {self.aux_noise}")
        if self.loader_workers < 0:
            raise ValueError(
                f"TrainConfig.loader_workers must be 0 (read in the loop) or more, got {self.loader_workers}"
            )
        for name, choices in (
            ("attention", Attention), ("oov_mask", OovMask), ("compile", Compile), ("loss", Loss),
            ("loss_mask_align", LossMaskAlign), ("optimizer", Optimizer), ("topk_tail", TopkTail), ("method", Method),
        ):  # fmt: skip
            if getattr(self, name) not in get_args(choices):
                raise ValueError(
                    f"TrainConfig.{name} must be one of {', '.join(get_args(choices))}, got {getattr(self, name)!r}"
                )
