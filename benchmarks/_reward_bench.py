"""Scoring logged rows: `reward --reward-model` against a bare batched forward, `reward --judge` against a bare client.

reward_model_vs_bare (one fresh process, `threads` torch threads, fp32): a random-weight Llama sequence
classifier (num_labels 1) with a byte-level BPE tokenizer and a chat template, and a dataset of `rows`
rows of random words (prompt 20-80 words, completion 10-120). Timed, after one untimed warm-up of each:
- ours: `score_with_reward_model` on the loaded model (dataset read, chat template, tokenization,
  token-budget batches, scores written, the output dataset written);
- bare: the same rows already in memory, the same chat template and tokenization, the same sorted
  token-budget batches through the model's forward, nothing written.
Rows/s of each; the ratio is ours / bare (median of `repeats` rounds, the order alternating), and the
same ratio from the process's CPU time (`*_cpu`: insensitive to other jobs' load on a shared machine).

judge_vs_bare_client: a local OpenAI-compatible endpoint (aiohttp, in its own process) that answers
every chat completion with "3" after `delay_s` (a model's latency). Timed: `judge_dataset` over `rows`
rows with `concurrency` calls in flight (rubric filled, audit written, dataset written), and a bare
asyncio + aiohttp client posting the same bodies with the same concurrency and reading each answer's
content. Rows/s of each; the ratio is ours / bare.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import child_environment, median, random_words, set_threads


def _write_text_dataset(path: Path, rows: int, seed: int = 0) -> str:
    from offline_rec.dataset.format import DatasetWriter, make_row

    rng = random.Random(seed)
    words = random_words(4000, seed)
    writer = DatasetWriter(path, task={"name": "bench"}, groups_per_shard=64)
    for g in range(0, rows, 4):
        prompt = " ".join(rng.choices(words, k=rng.randint(20, 80)))
        writer.add_group([make_row(group_id=f"g{g}", sample_index=k, prompt=prompt, prompt_ids=[4],
                                   completion=" ".join(rng.choices(words, k=rng.randint(10, 120))),
                                   completion_ids=[5], behavior_logprobs=[-1.0], meta={"answer": "x"})
                          for k in range(min(4, rows - g))])
    writer.close()
    return str(path)


def reward_model_vs_bare(workdir: str, rows: int, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                         repeats: int, threads: int, max_batch_tokens: int = 16384) -> dict:
    import shutil

    import torch

    from offline_rec.dataset.format import open_dataset
    from offline_rec.models.tiny import CHATML_TEMPLATE, build_bpe_tokenizer, build_tiny_reward_model, save_tiny
    from offline_rec.rewards.reward_model import score_with_reward_model, scoring_ids
    from offline_rec.rewards.sequence_classifier import load_reward_model

    set_threads(threads)
    work = Path(workdir)
    words = random_words(8 * vocab_size)
    tokenizer = build_bpe_tokenizer([" ".join(words[i:i + 64]) for i in range(0, len(words), 64)], vocab_size)
    tokenizer.chat_template = CHATML_TEMPLATE
    model_dir = save_tiny(build_tiny_reward_model(tokenizer, hidden_size=hidden_size, num_layers=num_layers,
                                                  num_heads=num_heads, max_position_embeddings=2048),
                          tokenizer, work / "reward-model")
    data = _write_text_dataset(work / "rows", rows)
    scorer = load_reward_model(model_dir)
    table = open_dataset(data).to_table(columns=["prompt", "completion", "meta"]).to_pylist()

    def ours(round_: int) -> tuple[float, float]:
        out = work / f"scored-{round_}"
        started, cpu = time.perf_counter(), time.process_time()
        score_with_reward_model(data, out, model_dir, progress=False, scorer=scorer,
                                max_batch_tokens=max_batch_tokens)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        shutil.rmtree(out)
        return rows / seconds, rows / cpu

    def bare() -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        seqs = [scoring_ids(scorer.tokenizer, r["prompt"], r["completion"], r["meta"]) for r in table]
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        pad = scorer.model.config.pad_token_id
        at = 0
        with torch.inference_mode():
            while at < len(order):
                width = len(seqs[order[at]])
                n = max(1, max_batch_tokens // width)
                batch = [seqs[i] for i in order[at:at + n]]
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for row, seq in enumerate(batch):
                    ids[row, :len(seq)] = torch.tensor(seq)
                    mask[row, :len(seq)] = 1
                scorer.model(input_ids=ids, attention_mask=mask).logits.float().tolist()
                at += n
        return rows / (time.perf_counter() - started), rows / (time.process_time() - cpu)

    ours(-1), bare()  # warm-up
    ours_rates, bare_rates, cpu_ratios = [], [], []
    for round_ in range(repeats):  # the order alternates, so that a change of the machine's load hits both alike
        first, second = (ours(round_), bare()) if round_ % 2 == 0 else reversed((bare(), ours(round_)))
        ours_rates.append(first[0])
        bare_rates.append(second[0])
        cpu_ratios.append(first[1] / second[1])
    return {"reward_model_vs_bare_forward": median(o / b for o, b in zip(ours_rates, bare_rates)),
            "reward_model_vs_bare_forward_cpu": median(cpu_ratios),
            "reward_model_rows_per_s": median(ours_rates), "bare_forward_rows_per_s": median(bare_rates),
            "reward_model_vs_bare_all": [o / b for o, b in zip(ours_rates, bare_rates)],
            "mean_tokens_per_row": sum(len(scoring_ids(scorer.tokenizer, r["prompt"], r["completion"], r["meta"]))
                                       for r in table) / len(table)}


# --------------------------------------------------------------------------------------------
# the judge


def serve_fake_judge(port: int, delay_s: float) -> None:
    """A chat-completions endpoint answering "3" after `delay_s`; runs until killed."""
    from aiohttp import web

    reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "3"}}]})

    async def handle(request):
        await request.read()
        await asyncio.sleep(delay_s)
        return web.Response(text=reply, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def judge_vs_bare_client(workdir: str, rows: int, concurrency: int, delay_s: float, repeats: int) -> dict:
    import shutil

    import aiohttp

    from offline_rec.dataset.format import open_dataset
    from offline_rec.rewards.judge import JudgeSettings, fill_rubric, judge_dataset

    work = Path(workdir)
    data = _write_text_dataset(work / "judge-rows", rows, seed=1)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks._common", "_reward_bench", "serve_fake_judge",
                               json.dumps({"port": port, "delay_s": delay_s})], env=child_environment(1),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the fake judge did not start") from None
                time.sleep(0.2)
        settings = JudgeSettings(url=f"http://127.0.0.1:{port}/v1", model="judge",
                                 rubric="Q: {prompt}\nA: {completion}", concurrency=concurrency, api_key_env=None)
        table = open_dataset(data).to_table().to_pylist()
        bodies = [settings.body(fill_rubric(settings.rubric, r, json.loads(r["meta"]))) for r in table]

        def ours(round_: int) -> float:
            out = work / f"judged-{round_}"
            started = time.perf_counter()
            summary = judge_dataset(data, out, settings, progress=False)
            seconds = time.perf_counter() - started
            assert summary["rewarded"] == rows, summary
            shutil.rmtree(out)
            return rows / seconds

        async def bare_run() -> None:
            semaphore = asyncio.Semaphore(concurrency)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
                async def one(body):
                    async with semaphore:
                        async with session.post(f"{settings.url}/chat/completions", json=body) as reply:
                            payload = await reply.json()
                    return float(payload["choices"][0]["message"]["content"])

                scores = await asyncio.gather(*(one(b) for b in bodies))
            assert len(scores) == rows

        def bare() -> float:
            started = time.perf_counter()
            asyncio.run(bare_run())
            return rows / (time.perf_counter() - started)

        ours(-1), bare()  # warm-up
        ours_rates, bare_rates = [], []
        for round_ in range(repeats):
            ours_rates.append(ours(round_))
            bare_rates.append(bare())
    finally:
        server.kill()
        server.wait()
    return {"judge_vs_bare_client": median(o / b for o, b in zip(ours_rates, bare_rates)),
            "judge_rows_per_s": median(ours_rates), "bare_client_rows_per_s": median(bare_rates),
            "judge_vs_bare_all": [o / b for o, b in zip(ours_rates, bare_rates)]}
