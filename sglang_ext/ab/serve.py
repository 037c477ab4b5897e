"""Server-level A/B: the same prompts against two OpenAI-compatible SGLang servers.

Seed 0 is the greedy pass (temperature 0, logprobs + top_logprobs requested): final-answer
agreement and token-level agreement. Seeds 1..n-1 sample with temperature 0.6, top_p 0.95
(the seed model card's GPQA protocol). pass@1 per arm = mean over seeds of the per-seed
accuracy on graded prompts, with its sample standard deviation. Truncated completions
(finish_reason "length") are counted separately from wrong answers. A run stopped by an
environment error (a server down, a timeout after the retries, an HTTP error, a malformed
answer) writes partial.json instead of report.json: the error, the requests answered and every
missing (arm, seed, prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...common.files import write_text_atomic
from ...common.progress import progress_bar
from . import plots
from .client import ChatClient, Completion
from .errors import ABError
from .prompts import Prompt, extract_answer, final_answer_key, load_prompts
from .report import fmt, markdown_table, write_json
from .serve_metrics import pass_at_1, summarize_agreements, token_agreement

@dataclass
class ServeConfig:
    """Options of `k3nvfp4-ab serve` (see cli.py for their help)."""

    arms: list[tuple[str, str]]  # [(name, base_url)]; the first is the baseline arm A
    out_dir: Path
    model: str | None = None
    prompts: str | None = None
    limit: int | None = None
    concurrency: int = 8
    retries: int = 3
    backoff_s: float = 1.0
    timeout_s: float = 3600.0
    max_tokens: int = 65536
    reasoning_effort: str | None = None
    seeds: int = 1
    top_logprobs: int = 5
    plots: bool = True  # --no-plots: report.json and summary.md only
    temperature: float = 0.6
    top_p: float = 0.95
    progress: bool = True


@dataclass
class RequestResult:
    arm: str
    seed: int
    prompt_id: str
    finish_reason: str | None
    answer: str | None
    correct: bool | None  # None for prompts without a gold answer
    truncated: bool
    completion_tokens: int | None
    content_chars: int
    reasoning_chars: int
    latency_s: float


@dataclass
class ServeABReport:
    """Everything the serve A/B measured; `to_dict()` is what report.json holds."""

    config: dict
    arms: dict[str, dict]
    greedy: dict
    accuracy: dict
    per_prompt: list[dict]
    definitions: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


DEFINITIONS = {
    "answer_extraction": "last 'Answer: X' (mc: letter within the choices; arith: number, commas/$ stripped, "
                         "42.0 == 42) in choices[0].message.content, else the last \\boxed{X}; reasoning_content "
                         "is never searched",
    "final_answer_match": "both arms' extracted answers equal; when an arm has no extractable answer, its "
                          "whitespace-normalised content is compared instead",
    "pass@1": "mean over seeds of per-seed accuracy on graded prompts; seed 0 greedy (temperature 0), seeds >= 1 "
              "temperature 0.6, top_p 0.95, request seed = seed index; std = sample std over seeds (ddof=1)",
    "truncated": "finish_reason == 'length'; reported apart from wrong answers (wrong_rate excludes truncated)",
    "token_metrics": "see k3nvfp4.sglang_ext.ab.serve_metrics: aligned positions 0..first divergence inclusive; "
                     "|delta logprob| of arm A's token; top-k KL over A's top-k plus one rest bucket "
                     "(lower bound of the full KL when exact)",
}


def _payload(cfg: ServeConfig, model: str, prompt: Prompt, seed: int) -> dict:
    p = {"model": model, "messages": [{"role": "user", "content": prompt.text}], "max_tokens": cfg.max_tokens,
         "seed": seed}
    if seed == 0:
        p.update(temperature=0.0, logprobs=True, top_logprobs=cfg.top_logprobs)
    else:
        p.update(temperature=cfg.temperature, top_p=cfg.top_p)
    if cfg.reasoning_effort:
        p["reasoning_effort"] = cfg.reasoning_effort
    return p


def _run_all(jobs: list[tuple[ChatClient, dict, tuple]], concurrency: int, progress: bool,
             out: dict[tuple, Completion]) -> None:
    """Run every request into ``out`` (key -> Completion), at most ``concurrency`` in flight in
    all (both arms together, started in ``jobs`` order, as the thread pool of the urllib client
    did: the servers see the same batches); the first environment error cancels the rest (queued
    and in flight) and is raised, with ``out`` holding the requests answered until then.
    Progress: requests done, and per arm requests/s and output tokens/s (the servers'
    usage.completion_tokens)."""
    asyncio.run(_run_all_async(jobs, concurrency, progress, out))


class _ArmRates:
    """Per-arm counts since the run started, as the progress bar's postfix."""

    def __init__(self, arms: list[str]) -> None:
        self.t0 = time.perf_counter()
        self.done = dict.fromkeys(arms, 0)
        self.tokens = dict.fromkeys(arms, 0)

    def add(self, arm: str, comp: Completion) -> str:
        self.done[arm] += 1
        self.tokens[arm] += comp.completion_tokens or 0
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return " | ".join(f"{a} {self.done[a] / dt:.2f} req/s {self.tokens[a] / dt:.1f} tok/s" for a in self.done)


async def _run_all_async(jobs: list[tuple[ChatClient, dict, tuple]], concurrency: int, progress: bool,
                         out: dict[tuple, Completion]) -> None:
    clients = list({id(c): c for c, _, _ in jobs}.values())
    async with contextlib.AsyncExitStack() as stack:
        sessions = {id(c): await stack.enter_async_context(c.session(concurrency)) for c in clients}
        slots = asyncio.Semaphore(max(1, concurrency))  # FIFO: requests start in jobs order
        # bars=False: plain status lines (LogProgress), as the cast and the tuner print without a terminal.
        bar = progress_bar(len(jobs), "requests", bars=progress, unit="req")
        rates = _ArmRates([c.name for c in clients])

        async def one(client: ChatClient, payload: dict, key: tuple) -> None:
            async with slots:
                comp = await client.achat(sessions[id(client)], payload)
            out[key] = comp
            bar.set_postfix_str(rates.add(client.name, comp), refresh=False)
            bar.update(1)

        tasks = [asyncio.ensure_future(one(c, payload, key)) for c, payload, key in jobs]
        try:
            for fut in asyncio.as_completed(tasks):
                await fut  # the first failure raises here
        finally:
            # On failure report at once: queued and in-flight requests are cancelled (their
            # connections closed), not waited for.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()


def _config_dict(cfg: ServeConfig) -> dict:
    """The run's options as JSON values (paths as strings), for report.json and partial.json."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}


def _write_partial(cfg: ServeConfig, jobs: list, comps: dict[tuple, Completion], error: ABError) -> Path:
    """partial.json (what failed, what was answered, every missing request) and the answered
    completions, for a run stopped by an environment error. report.json is not written."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = [{"arm": arm, "seed": seed, "prompt_id": pid} for _, _, (arm, seed, pid) in jobs
               if (arm, seed, pid) not in comps]
    answered = [{"arm": arm, "seed": seed, "prompt_id": pid, "finish_reason": c.finish_reason, "content": c.content,
                 "completion_tokens": c.completion_tokens} for (arm, seed, pid), c in sorted(comps.items())]
    write_text_atomic(out / "completions.partial.jsonl", "".join(json.dumps(a) + "\n" for a in answered))
    path = out / "partial.json"
    write_json(path, {"complete": False, "error": {"type": type(error).__name__, "message": str(error)},
                      "requests": len(jobs), "answered": len(comps), "missing": missing,
                      "files": {"completions": "completions.partial.jsonl"}, "config": _config_dict(cfg)})
    return path


def run_serve_ab(cfg: ServeConfig) -> ServeABReport:
    """Run the server-level A/B and write report.json, summary.md, completions.jsonl and PNGs
    into cfg.out_dir. Raises ABError subclasses on environment problems."""
    if len(cfg.arms) != 2:
        raise ABError(f"serve A/B needs exactly two --arm NAME=URL, got {len(cfg.arms)}")
    if cfg.arms[0][0] == cfg.arms[1][0]:
        raise ABError(f"the two arms need different names, both are {cfg.arms[0][0]!r}")
    if cfg.seeds < 1:
        raise ABError(f"--seeds must be >= 1, got {cfg.seeds}")
    prompts = load_prompts(cfg.prompts, limit=cfg.limit)
    clients = [ChatClient(n, u, timeout_s=cfg.timeout_s, retries=cfg.retries, backoff_s=cfg.backoff_s)
               for n, u in cfg.arms]
    arms_info: dict[str, dict] = {}
    for c in clients:  # reachability check before queueing hundreds of requests
        served = c.models()
        model = cfg.model or (served[0] if served else None)
        if model is None:
            raise ABError(f"arm '{c.name}' ({c.base_url}) serves no model and --model was not given")
        arms_info[c.name] = {"url": c.base_url, "model": model, "served_models": served}

    jobs = [(c, _payload(cfg, arms_info[c.name]["model"], p, s), (c.name, s, p.id))
            for s in range(cfg.seeds) for c in clients for p in prompts]
    t0 = time.perf_counter()
    comps: dict[tuple, Completion] = {}
    try:
        _run_all(jobs, cfg.concurrency, cfg.progress, comps)
    except ABError as e:
        path = _write_partial(cfg, jobs, comps, e)
        raise type(e)(f"{e}\npartial report: {path} ({len(comps)} of {len(jobs)} requests answered; "
                      "partial.json lists the missing ones; no report.json)") from e
    wall = time.perf_counter() - t0

    results: dict[tuple, RequestResult] = {}
    by_id = {p.id: p for p in prompts}  # ids are unique (load_prompts)
    for (arm, seed, pid), comp in comps.items():
        p = by_id[pid]
        ans = extract_answer(comp.content, p.kind, p.num_choices)
        results[(arm, seed, pid)] = RequestResult(
            arm, seed, pid, comp.finish_reason, ans, None if p.answer is None else ans == p.answer,
            comp.finish_reason == "length", comp.completion_tokens, len(comp.content or ""),
            len(comp.reasoning_content or ""), comp.latency_s)

    a, b = clients[0].name, clients[1].name
    # Greedy pass (seed 0): answer agreement and token-level agreement.
    per_prompt, agreements, matches = [], [], 0
    missing_logprobs = {a: 0, b: 0}
    for p in prompts:
        ca, cb = comps[(a, 0, p.id)], comps[(b, 0, p.id)]
        ka, kb = final_answer_key(ca.content, p), final_answer_key(cb.content, p)
        matches += ka == kb
        row = {"id": p.id, "kind": p.kind, "gold": p.answer, f"answer_{a}": results[(a, 0, p.id)].answer,
               f"answer_{b}": results[(b, 0, p.id)].answer, "final_answer_match": ka == kb,
               f"finish_{a}": ca.finish_reason, f"finish_{b}": cb.finish_reason}
        for name, comp in ((a, ca), (b, cb)):
            missing_logprobs[name] += comp.tokens is None
        if ca.tokens is not None and cb.tokens is not None:
            ag = token_agreement(ca.tokens, cb.tokens)
            agreements.append(ag)
            row.update(first_divergence=ag.first_divergence, tokens_a=ag.n_tokens_a, tokens_b=ag.n_tokens_b,
                       max_abs_dlogprob=ag.dlogprob_max if ag.dlogprob_n else None)
        per_prompt.append(row)
    greedy = {"baseline_arm": a, "other_arm": b, "prompts": len(prompts),
              "final_answer_match_rate": matches / len(prompts),
              "prompts_without_logprobs": missing_logprobs, **summarize_agreements(agreements)}

    # Accuracy pass: per arm, per seed, graded prompts only.
    graded = [p for p in prompts if p.answer is not None]
    accuracy: dict[str, dict] = {}
    for c in clients:
        rs = [results[(c.name, s, p.id)] for s in range(cfg.seeds) for p in prompts]
        arm_acc = {"requests": len(rs),
                   "truncation_rate": sum(r.truncated for r in rs) / len(rs),
                   "mean_latency_s": sum(r.latency_s for r in rs) / len(rs)}
        for subset, ps in (("all_graded", graded), ("mc", [p for p in graded if p.kind == "mc"]),
                           ("arith", [p for p in graded if p.kind == "arith"])):
            if not ps:
                continue
            per_seed, wrong, trunc, noans = [], 0, 0, 0
            for s in range(cfg.seeds):
                rr = [results[(c.name, s, p.id)] for p in ps]
                per_seed.append(sum(bool(r.correct) for r in rr) / len(rr))
                trunc += sum(r.truncated for r in rr)
                wrong += sum((not r.correct) and not r.truncated and r.answer is not None for r in rr)
                noans += sum(r.answer is None and not r.truncated for r in rr)
            n = len(ps) * cfg.seeds
            mean, std = pass_at_1(per_seed)
            arm_acc[subset] = {"prompts": len(ps), "pass@1": mean, "std": std, "per_seed": per_seed,
                               "wrong_rate": wrong / n, "truncated_rate": trunc / n, "no_answer_rate": noans / n}
        accuracy[c.name] = arm_acc

    cfg_d = _config_dict(cfg)
    cfg_d["prompt_set"] = cfg.prompts or "built-in default_prompts.jsonl"
    cfg_d["wall_s"] = wall
    report = ServeABReport(cfg_d, arms_info, greedy, accuracy, per_prompt, DEFINITIONS)
    _write_serve_outputs(report, cfg, comps, results)
    return report


def summary_markdown(rep: ServeABReport) -> str:
    """The summary.md text (also printed by the CLI)."""
    g = rep.greedy
    a, b = g["baseline_arm"], g["other_arm"]
    lines = [f"# Serve A/B: {a} vs {b}", "",
             f"Prompts: {g['prompts']} ({rep.config['prompt_set']}), seeds: {rep.config['seeds']}, "
             f"max_tokens: {rep.config['max_tokens']}, reasoning_effort: {rep.config['reasoning_effort']}", "",
             "## Greedy pass (seed 0)", "",
             markdown_table(["metric", "value"], [
                 ["final-answer match rate", fmt(g["final_answer_match_rate"], ".3f")],
                 ["identical token streams", f"{g['identical_token_streams']}/{g['prompts']}"],
                 ["median first-divergence position", g["median_first_divergence"]],
                 ["top-1 token agreement (aligned positions)", fmt(g["top1_agreement"], ".4f")],
                 ["mean abs delta logprob", fmt(g["mean_abs_dlogprob"], ".3g")],
                 ["max abs delta logprob", fmt(g["max_abs_dlogprob"], ".3g")],
                 ["mean top-k KL (nats, approx.)", fmt(g["mean_topk_kl"], ".3g")],
                 ["aligned positions", g["aligned_positions"]],
             ]), "", "## Accuracy (pass@1 over seeds)", ""]
    rows = []
    for arm, acc in rep.accuracy.items():
        for subset in ("all_graded", "mc", "arith"):
            if subset in acc:
                s = acc[subset]
                rows.append([arm, subset, s["prompts"], f"{100*s['pass@1']:.2f}", f"{100*s['std']:.2f}",
                             f"{100*s['wrong_rate']:.2f}", f"{100*s['truncated_rate']:.2f}", f"{100*s['no_answer_rate']:.2f}"])
    lines.append(markdown_table(["arm", "set", "prompts", "pass@1 %", "std %", "wrong %", "truncated %", "no answer %"], rows))
    lines += ["", "Definitions: see report.json `definitions`.", ""]
    return "\n".join(lines)


def _write_serve_outputs(rep: ServeABReport, cfg: ServeConfig, comps: dict, results: dict) -> None:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for key in sorted(comps):
        c, r = comps[key], results[key]
        lines.append(json.dumps({**asdict(r), "content": c.content, "reasoning_content": c.reasoning_content}))
    write_text_atomic(out / "completions.jsonl", "\n".join(lines) + "\n")
    arms = list(rep.accuracy)
    rep.files = {"report": "report.json", "summary": "summary.md", "completions": "completions.jsonl"}
    write_text_atomic(out / "summary.md", summary_markdown(rep))
    write_json(out / "report.json", rep.to_dict())
    if cfg.plots:  # optional, after the report: a plot never loses it (plots.draw_all)
        g = rep.greedy
        todo = {"divergence_plot": ("divergence_hist.png", lambda path: plots.divergence_histogram(
            path, g["first_divergence_positions"], g["identical_token_streams"], g["prompts"],
            f"greedy first divergence: {g['other_arm']} vs {g['baseline_arm']}"))}
        if all("all_graded" in rep.accuracy[x] for x in arms):
            todo["accuracy_plot"] = ("accuracy.png", lambda path: plots.accuracy_bars(
                path, arms, [rep.accuracy[x]["all_graded"]["pass@1"] for x in arms],
                [rep.accuracy[x]["all_graded"]["std"] for x in arms],
                [rep.accuracy[x]["truncation_rate"] for x in arms], "pass@1 per arm (+-1 std over seeds)"))
        drawn, skipped = plots.draw_all(out, todo)
        rep.files.update(drawn)
        if skipped:
            rep.files["plots_skipped"] = skipped
        write_json(out / "report.json", rep.to_dict())
    for stale in ("partial.json", "completions.partial.jsonl"):  # of an earlier, failed run into this directory
        (out / stale).unlink(missing_ok=True)
