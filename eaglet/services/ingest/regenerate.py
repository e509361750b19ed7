"""Responses written by the target itself: EAGLE-3 drafters learn best on the target's own text.

``eaglet regenerate PROMPTS OUT`` reads prompts (JSONL ``{"id", "prompt"}``), asks the inference server
for the target's answer to each, and writes conversations (``{"id", "messages": [user, assistant]}``) ready
for ingest.
"""

import argparse
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from eaglet.shared.config import Settings
from eaglet.shared.target import resolve_model_dir

log = logging.getLogger(__name__)


def regenerate(
    prompts_file: Path,
    out_file: Path,
    tokenizer: PreTrainedTokenizerBase,
    inference_url: str,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    concurrency: int = 8,
) -> int:
    """Writes one conversation per prompt, in the prompts' order; returns how many were written."""
    prompts = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    http = httpx.Client(base_url=inference_url, timeout=600)

    def answer(item: dict) -> dict:
        messages = [{"role": "user", "content": item["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
        response = http.post("/generate", json=body)
        response.raise_for_status()
        reply = response.json()["text"].strip()
        return {"id": item["id"], "messages": [*messages, {"role": "assistant", "content": reply}]}

    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_suffix(".tmp")
    with ThreadPoolExecutor(concurrency) as pool, open(tmp, "w") as out:
        for n, conversation in enumerate(pool.map(answer, prompts), start=1):
            out.write(json.dumps(conversation, ensure_ascii=False) + "\n")
            if n % 20 == 0:
                log.info("regenerate: %d/%d", n, len(prompts))
    tmp.rename(out_file)
    return len(prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet regenerate", description=__doc__)
    parser.add_argument("prompts", type=Path, help='JSONL of {"id", "prompt"}')
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(settings.model, settings.model_cache_dir))
    n = regenerate(
        args.prompts,
        args.out,
        tokenizer,
        settings.inference_url,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        concurrency=args.concurrency,
    )
    sys.stdout.write(f"{n} conversations written to {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
