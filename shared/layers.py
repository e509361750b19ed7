"""Which layers' states EAGLE-3 takes: id i is the residual stream entering layer i (the output of layer i-1), as
the dumps record them and vLLM reads them. SGLang adds one to each id it is handed (``set_eagle3_layers_to_capture``,
``--return-aux-hidden-state-layer-ids``, a draft config's ``eagle_config``), so it is handed them one lower. The
SGLang plugin, its launcher, the reference server and ingest all use these rules."""


def default_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default [2, L//2, L-3] where those are distinct (L >= 7); below, [L-3, L-2, L-1].

    SGLang's rule alone gives repeated or unordered ids for small models (L=4: [2, 2, 1]).
    """
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return [num_layers - 3, num_layers - 2, num_layers - 1]


def layer_ids_problem(ids: list[int], num_layers: int | None) -> str | None:
    """Why ``ids`` cannot be captured (None: they can). The aux states come out in layer order, so
    the ids must rise; id 0 would be the embeddings and id L the final states, both already at hand."""
    if len(ids) != 3:
        return f"give three layer ids, not {len(ids)}"
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        return "give distinct layer ids in increasing order (the aux states come out in layer order)"
    if ids[0] < 1:
        return "layer ids start at 1 (id 0 would be the embeddings, the input of layer 0)"
    if num_layers is not None and ids[-1] >= num_layers:
        if num_layers < 4:
            return f"the model has {num_layers} layers: three distinct capture points need at least 4"
        return f"the model has {num_layers} layers: give ids from 1 to {num_layers - 1}"
    return None


def sglang_arg_ids(ids: list[int]) -> list[int]:
    """The ids to hand SGLang for layers ``ids``: one lower, since it adds one to each id it reads."""
    return [i - 1 for i in ids]
