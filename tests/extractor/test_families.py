"""Every target family transformers runs on the CPU, end to end: a tiny random-weight model of the family, saved as a
published checkpoint is, a few conversations ingested, extracted through the reference server over real HTTP, a
drafter trained for a few steps. The drafter's config.json carries the family's drafter shape (the target's
grouped-query shape, or the rule's 128-wide heads for latent attention), plain RoPE over the target's base, and the
layers the dumps captured; the trainer's own loader reads it back and it runs."""

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from eaglet.services.extractor.extract import Extractor
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.services.trainer.checkpoint import load_drafter
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.config import Settings
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import decode_states, drafter_dir, open_sample, read_metadata, sample_path, samples_dir
from eaglet.shared.targettensors import load_target_tensors

LAYERS = 7  # the default capture rule [2, L//2, L-3] applies from 7 layers on
CAPTURED = [2, LAYERS // 2, LAYERS - 3]
CONVERSATIONS = 4
TTT_STEPS = 2


@dataclass(frozen=True)
class Family:
    architecture: str
    hidden: int
    rope_theta: float
    shape: tuple[int, int, int]
    """The drafter's (heads, KV heads, head_dim)."""
    yarn_factor: float | None = None


FAMILIES = {
    # the target's grouped-query shape, head size hidden / heads
    "llama": Family("LlamaForCausalLM", 64, 500000.0, (4, 2, 16)),
    # the target's, with its own head_dim (heads * head_dim twice hidden)
    "qwen3": Family("Qwen3ForCausalLM", 64, 1000000.0, (4, 2, 32)),
    "qwen3-moe": Family("Qwen3MoeForCausalLM", 64, 1000000.0, (4, 2, 32)),
    # latent attention lends no shape: the rule's head_dim 128, hidden / 128 heads, gcd(heads, 8) KV heads
    "deepseek-v3": Family("DeepseekV3ForCausalLM", 128, 10000.0, (1, 1, 128), yarn_factor=4.0),
    "gpt-oss": Family("GptOssForCausalLM", 64, 150000.0, (4, 2, 16)),
}


def target_config(name: str, family: Family, vocab: int, pad: int, eos: int):
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=family.hidden, num_hidden_layers=LAYERS, max_position_embeddings=2048,
                  tie_word_embeddings=False, eos_token_id=eos, pad_token_id=pad,
                  rope_parameters={"rope_type": "default", "rope_theta": family.rope_theta})  # fmt: skip
    gqa = dict(num_attention_heads=4, num_key_value_heads=2)
    if name == "llama":
        return T.LlamaConfig(**common, **gqa, intermediate_size=128)
    if name == "qwen3":
        return T.Qwen3Config(**common, **gqa, intermediate_size=128, head_dim=32)
    if name == "qwen3-moe":
        return T.Qwen3MoeConfig(**common, **gqa, intermediate_size=128, head_dim=32, moe_intermediate_size=32,
                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[])  # fmt: skip
    if name == "deepseek-v3":
        yarn = {"rope_type": "yarn", "rope_theta": family.rope_theta, "factor": family.yarn_factor,
                "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                "mscale_all_dim": 1.0}  # fmt: skip
        return T.DeepseekV3Config(**{**common, "rope_parameters": yarn}, num_attention_heads=4, num_key_value_heads=4,
                                  intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                  topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32,
                                  kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                  v_head_dim=32)  # fmt: skip
    if name == "gpt-oss":
        return T.GptOssConfig(**common, **gqa, intermediate_size=64, head_dim=16, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=16,
                              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(LAYERS)])  # fmt: skip
    raise ValueError(name)


def make_target(folder: Path, name: str, tokenizer_dir: Path) -> Path:
    """A tiny random model of the family with the tests' tokenizer, written with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = target_config(name, FAMILIES[name], len(tok), tok.pad_token_id, tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == FAMILIES[name].architecture
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if name == "deepseek-v3":
        published_rope(folder / "config.json")
    return folder


def published_rope(path: Path) -> None:
    """The rope in the spelling DeepSeek-V3's published config.json has: ``rope_theta`` and ``rope_scaling``."""
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope["rope_type"]}
    path.write_text(json.dumps(config, indent=1))


def target_rope(model_dir: Path) -> tuple[float, dict | None]:
    """The target's RoPE base and scaling (None: plain), in either spelling."""
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    scaling = config.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling


class Server:
    def __init__(self, name: str, url: str, dump_dir: Path, engine: ReferenceEngine):
        self.name, self.url, self.dump_dir, self.engine = name, url, dump_dir, engine
        self.model_dir = engine.model_dir


@pytest.fixture(scope="module", params=list(FAMILIES))
def server(request, tmp_path_factory, smollm2_dir, serve_reference):
    """The reference server on the family's tiny model, over real HTTP, capturing its default layers."""
    name = request.param
    folder = tmp_path_factory.mktemp(f"family-{name}")
    model_dir = make_target(folder / "model", name, smollm2_dir)
    engine = ReferenceEngine(model_dir)
    dump_dir = folder / "dump"
    with serve_reference(engine, dump_dir) as url:
        yield Server(name, url, dump_dir, engine)


def conversations(path: Path) -> Path:
    topics = ["tides", "bread", "glaciers", "chess", "bees", "lighthouses"]
    with path.open("w") as f:
        for i, topic in enumerate(topics[:CONVERSATIONS]):
            messages = [{"role": "user", "content": f"Tell me one thing about {topic}."},
                        {"role": "assistant", "content": f"Here is one thing about {topic}: it is older than it "
                                                         f"looks, and {i + 2} people in a row said so."}]  # fmt: skip
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


def test_a_family_target_trains_a_drafter_of_its_shape(redis, redis_server, server, tmp_path):
    family, run = FAMILIES[server.name], server.name
    settings = Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", dump_dir=server.dump_dir,
                        model=str(server.model_dir), inference_url=server.url)  # fmt: skip
    ingest_new_run(redis, settings, run, conversations(tmp_path / "chats.jsonl"), RunOptions())
    state = RunState(redis, run)
    assert state.meta().aux_layer_ids == CAPTURED

    with httpx.Client(base_url=server.url, timeout=60) as http:
        work = Extractor(redis=redis, http=http, data_dir=settings.data_dir, dump_dir=settings.dump_dir, worker="t",
                         backoff_s=(0.01,))  # fmt: skip
        for i in range(CONVERSATIONS):
            assert work.extract(run, i).startswith("done"), i
    assert state.counts().done == CONVERSATIONS
    assert state.meta().captured_layers == CAPTURED
    samples = SampleSet(samples_dir(settings.data_dir, run))
    assert len(samples) == CONVERSATIONS
    stored = [sample_path(settings.data_dir, run, samples[i].sample_id) for i in range(CONVERSATIONS)]
    for path in stored:
        assert json.loads(read_metadata(path)["aux_layer_ids"]) == CAPTURED, path.name  # as the dump recorded

    cfg = TrainConfig(ttt_steps=TTT_STEPS, draft_vocab_size=256, tokens_per_batch=256, max_steps=2, loader_workers=0,
                      heldout_fraction=0.0)  # fmt: skip
    final = train(redis=redis, run_id=run, data_dir=settings.data_dir, target_dir=server.model_dir, cfg=cfg,
                  env=Dist())  # fmt: skip
    assert final["step"] == 2
    folder = drafter_dir(settings.data_dir, run)
    config = json.loads((folder / "config.json").read_text())
    target_theta, target_scaling = target_rope(server.model_dir)
    assert target_theta == family.rope_theta
    assert (target_scaling or {}).get("factor") == family.yarn_factor  # DeepSeek-V3's YaRN, the others none
    served = server.engine.model.config.rope_parameters  # the rope the served target ran
    assert served["rope_type"] == ("yarn" if family.yarn_factor else "default")
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert heads == family.shape
    assert config["hidden_size"] == family.hidden and config["rope_theta"] == target_theta
    assert config["rope_scaling"] is None  # plain RoPE, whatever the target's scaling
    assert config["eagle_aux_hidden_state_layer_ids"] == CAPTURED
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in CAPTURED]

    embed = load_target_tensors(server.model_dir)["embed"].float()
    drafter = load_drafter(folder, embed).eval()
    tensors = open_sample(stored[0])
    aux = decode_states(tensors, read_metadata(stored[0]), torch.float32)["aux_hidden_states"]
    ids = tensors["input_ids"].long()
    assert aux.shape == (len(ids), 3 * family.hidden)
    with torch.no_grad():
        outs = list(drafter.unroll(ids[None], aux[None], steps=TTT_STEPS))
        logits = drafter.logits(outs[-1])
    assert logits.shape == (1, len(ids), 256) and torch.isfinite(logits).all()
