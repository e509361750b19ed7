"""The bundled model itself through the reference engine: its dumps are SmolLM2's own states."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.services.inference.engine import ReferenceEngine


def test_smollm2_states_and_answer(smollm2_dir):
    engine = ReferenceEngine(smollm2_dir, device="cpu")
    assert engine.aux_layer_ids == [2, 15, 27] and engine.hidden_size == 576
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)).input_ids
    [prefill] = engine.prefill([ids])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    # transformers' last hidden state is after the final norm: what the LM head reads.
    torch.testing.assert_close(prefill.states["hidden_states"], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        prefill.states["aux_hidden_states"][:, :576], out.hidden_states[2][0], atol=1e-4, rtol=1e-4
    )
    assert tokenizer.decode(engine.generate([ids], max_new_tokens=12, temperature=0, top_p=1)[0]).startswith(
        "The capital of France is Paris"
    )
