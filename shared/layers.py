"""Which target layers' states a drafter takes: id i is the residual stream entering layer i (the output of layer
i-1), as the dumps record them and vLLM reads them. SGLang adds one to each id it is handed
(``set_eagle3_layers_to_capture``, ``set_dflash_layers_to_capture``, ``--return-aux-hidden-state-layer-ids``, a draft
config's ``eagle_config``), so it is handed them one lower. The SGLang plugin, its launcher, the reference server and
ingest all use these rules.

A capture takes any rising list of ids: EAGLE-3 reads three (``default_layer_ids``), DFlash one per draft layer
(``dflash_layer_ids``), and one server may capture the union for runs of both, each run storing its own.
"""

EAGLE3_NUM_LAYERS = 3
DFLASH_DEFAULT_DRAFT_LAYERS = 5
"""Draft layers of a DFlash drafter whose run names none: the published DFlash drafters' count. SGLang fixes none
itself: it reads a drafter's ``dflash_config.target_layer_ids``, else derives them from the drafter's own layer
count (``build_target_layer_ids``)."""


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's layers: SGLang's default [2, L//2, L-3] where those are distinct (L >= 7); below, [L-3, L-2, L-1].

    SGLang's rule alone gives repeated or unordered ids for small models (L=4: [2, 2, 1]).
    """
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return [num_layers - 3, num_layers - 2, num_layers - 1]


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's layers for a drafter of ``num_draft_layers`` layers, as SGLang resolves a drafter config without
    ``target_layer_ids``: its ``build_target_layer_ids`` spreads the outputs of layers 1 to L-3 evenly (one draft
    layer: the output of layer L//2), and ``set_dflash_layers_to_capture`` captures each one layer up, the input of
    the next: eaglet's ids are those plus one."""
    if num_draft_layers < 1:
        raise ValueError(f"DFlash draft layers {num_draft_layers}: give at least 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2 + 1]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"a DFlash drafter needs a target of at least 4 layers, this one has {num_target_layers}")
    span = end - start
    # round() as SGLang's: Python's, halves to even
    ids = [int(round(start + i * span / (num_draft_layers - 1))) + 1 for i in range(num_draft_layers)]
    if len(set(ids)) < len(ids):
        raise ValueError(f"{num_draft_layers} DFlash draft layers over a target of {num_target_layers} layers repeat "
                         f"target layers ({ids}): give the layers (aux_layer_ids) or fewer draft layers")  # fmt: skip
    return ids


def layer_ids_problem(ids: list[int], num_layers: int | None, count: int | None = None) -> str | None:
    """Why ``ids`` cannot be captured (None: they can); ``count``: the number of ids a drafter reads (EAGLE-3's
    three), None for a capture of any number. The aux states come out in layer order, so the ids must rise; id 0
    would be the embeddings and id L the final states, both already at hand."""
    if not ids:
        return "give at least one layer id"
    if count is not None and len(ids) != count:
        return f"give {count} layer ids, not {len(ids)}"
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        return "give distinct layer ids in increasing order (the aux states come out in layer order)"
    if ids[0] < 1:
        return "layer ids start at 1 (id 0 would be the embeddings, the input of layer 0)"
    if num_layers is not None and ids[-1] >= num_layers:
        if num_layers < len(ids) + 1:
            return f"the model has {num_layers} layers: {len(ids)} distinct capture points need at least {len(ids) + 1}"
        return f"the model has {num_layers} layers: give ids from 1 to {num_layers - 1}"
    return None


def parse_layer_ids(text: str, where: str) -> list[int]:
    """``1,9,17`` -> [1, 9, 17]; ``ValueError`` naming ``where`` (a setting, a flag) for anything else."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError as e:
        raise ValueError(f"{where}={text!r}: give comma-separated layer ids, e.g. 2,15,27") from e


def sglang_arg_ids(ids: list[int]) -> list[int]:
    """The ids to hand SGLang for layers ``ids``: one lower, since it adds one to each id it reads."""
    return [i - 1 for i in ids]
