"""Server-level A/B: the same prompts against two OpenAI-compatible SGLang servers.

Seed 0 is the greedy pass (temperature 0, logprobs + top_logprobs requested): final-answer
agreement and token-level agreement. Seeds 1..n-1 sample with temperature 0.6, top_p 0.95
(the seed model card's GPQA protocol). Per arm: pass@1[avg-of-N] with its SEM over seeds,
majority@N, truncated and empty-answer rates (stats.py), and the speed of the same requests
(speed.py); between the arms, the paired difference with its standard error, a bootstrap
interval over questions, McNemar counts of the greedy pass and a verdict (stats.py). Prompts:
the project's JSONL, GPQA's CSV or NeMo-Skills' GPQA JSONL (datasets.py). Each request is graded
by grading.py (GRADING_RULE: the extracted answer against the gold one, whatever the
finish_reason, as NeMo-Skills grades); truncated completions (finish_reason "length") are
counted beside the score. A run stopped by an environment error from the pre-flight check of the
endpoints on (a server down, a timeout after the retries, an HTTP error, a malformed answer)
writes partial.json instead of report.json: the error, the stage, the requests answered and
every missing (arm, seed, prompt). Bad input (a prompt file, a template, an --out that cannot be
written) is refused before that, and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...common.files import write_text_atomic
from ...common.outputs import OutputPathError, check_output_dir
from ...common.progress import format_rate, progress_bar
from . import plots
from .client import ChatClient, Completion, require_httpx
from .datasets import load_prompt_set
from .errors import ABError, InputError
from .grading import GRADING_RULE, grade
from .prompts import Prompt, final_answer_key
from .report import fmt, markdown_table, write_json
from .serve_metrics import pass_at_1, summarize_agreements, token_agreement
from .speed import arm_speed
from .stats import arm_accuracy, compare
from .verdict import DEFAULT_BOUND_NATS, decide, verdict_markdown

@dataclass
class ServeConfig:
    """Options of `k3nvfp4-ab serve` (see cli.py for their help)."""

    arms: list[tuple[str, str]]  # [(name, base_url)]; the first is the baseline arm A
    out_dir: Path
    model: str | None = None
    prompts: str | None = None
    prompts_format: str = "auto"  # datasets.FORMATS
    choice_seed: int = 0  # gpqa-csv: the seed of each question's choice order
    prompt_template: str | None = None  # a template file for multiple-choice prompts
    limit: int | None = None
    concurrency: int = 8
    retries: int = 3
    backoff_s: float = 1.0
    timeout_s: float = 3600.0
    max_tokens: int = 65536
    reasoning_effort: str | None = None
    seeds: int = 1
    top_logprobs: int = 5
    bootstrap_resamples: int = 10000
    bootstrap_seed: int = 0
    plots: bool = True  # --no-plots: report.json and summary.md only
    temperature: float = 0.6
    top_p: float = 0.95
    progress: bool = True
    dlogprob_bound: float = DEFAULT_BOUND_NATS  # nats, the verdict's bound (verdict.py)


@dataclass
class RequestResult:
    arm: str
    seed: int
    prompt_id: str
    finish_reason: str | None
    answer: str | None
    answer_source: str | None  # "content", "reasoning_content" (content empty) or None (no answer)
    correct: bool | None  # None for prompts without a gold answer
    truncated: bool
    completion_tokens: int | None
    content_chars: int
    reasoning_chars: int
    latency_s: float
    start_s: float  # request start and end, s after the run's start (end = start + latency_s)
    end_s: float


@dataclass
class ServeABReport:
    """Everything the serve A/B measured; `to_dict()` is what report.json holds."""

    config: dict
    arms: dict[str, dict]
    greedy: dict
    accuracy: dict
    per_prompt: list[dict]
    definitions: dict = field(default_factory=dict)
    dataset: dict = field(default_factory=dict)
    comparison: dict | None = None  # stats.PairedComparison of the arms on all graded prompts
    speed: dict = field(default_factory=dict)  # arm -> speed.ArmSpeed
    files: dict = field(default_factory=dict)
    verdict: dict | None = None  # verdict.Verdict of the greedy pass

    def to_dict(self) -> dict:
        return asdict(self)


DEFINITIONS = {
    "answer_extraction": "in choices[0].message.content, or in reasoning_content when content is empty (answer_source "
                         "says which): mc: the last 'Answer: X' (X any case, a letter within the choices) or "
                         "'answer is X' (X upper case), else the last \\boxed{X}; arith: the last 'Answer: N' "
                         "(commas/$ stripped, 42.0 == 42), else the last \\boxed{N}",
    "final_answer_match": "both arms' extracted answers equal; when an arm has no extractable answer, its "
                          "whitespace-normalised graded text is compared instead",
    "grading": GRADING_RULE,
    "pass@1": "pass@1[avg-of-N]: mean over the N seeds of the per-seed accuracy on graded prompts (each request "
              "graded by the 'grading' rule); seed 0 greedy (temperature 0), seeds >= 1 temperature 0.6, top_p 0.95, "
              "request seed = seed index; std = sample std of the per-seed accuracies (ddof=1; 0 for one seed), "
              "sem = std / sqrt(N) (NeMo-Skills' std_err_across_runs; null for one seed)",
    "majority@N": "per question the most common extracted answer over its N requests (unanswered ones left out; "
                  "none: 0; a tie scores the mean correctness of the tied answers, as NeMo-Skills), mean over questions",
    "truncated": "finish_reason == 'length'; truncated_rate counts them whatever their grade; wrong_rate and "
                 "no_answer_rate leave them out (a truncated request with a right answer counts in pass@1)",
    "answered_rate": "share of requests with an extractable answer (truncated ones included); 0 means nothing was "
                     "graded in substance: every score is 0 by rule, and no comparison is made",
    "empty_answer_rate": "share of requests without an extractable answer, truncated ones included "
                         "(no_answer_rate: the same without the truncated ones)",
    "comparison": "B = the second arm against A = the first, all graded prompts, paired on questions and seeds; "
                  "diff_pp = 100 (pass@1_B - pass@1_A); se_pp = 100 std(d_q, ddof=1) / sqrt(Q), d_q = question q's "
                  "mean-over-seeds correctness of B minus A; sigmas = diff_pp / se_pp; unpaired_se_pp = "
                  "100 sqrt(sem_A^2 + sem_B^2); ci95_pp: percentile bootstrap of mean(d_q) over questions resampled "
                  "with replacement (scipy.stats.bootstrap, seed in bootstrap.seed); mcnemar: seed 0 (greedy) "
                  "questions only A / only B gets right, exact two-sided p (scipy.stats.binomtest, p = 1/2); the "
                  "verdict names a difference only when ci95_pp excludes 0",
    "speed": "per arm, the same requests: latency_s = client-side wall time of a request (retries included), "
             "p50/p90/p99 by linear interpolation; tokens_per_s_per_request = usage.completion_tokens / latency; "
             "aggregate_tokens_per_s = total usage.completion_tokens / wall_span_s (the arm's first request start "
             "to its last answer)",
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
        # Three significant digits, as the bar's own rate: a slow CPU server reads 0.0444 tok/s, not 0.0.
        return " | ".join(f"{a} {format_rate(self.done[a] / dt, 'req')} {format_rate(self.tokens[a] / dt, 'tok')}"
                          for a in self.done)


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


def _write_partial(cfg: ServeConfig, keys: list[tuple], comps: dict[tuple, Completion], error: ABError,
                   stage: str) -> Path:
    """partial.json (what failed, at which stage, what was answered, every missing request) and
    the answered completions, for a run stopped by an environment error. report.json is not
    written. keys: every request's (arm, seed, prompt id); stage: "pre-flight" (the endpoints'
    /v1/models check, before any request) or "requests"."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = [{"arm": arm, "seed": seed, "prompt_id": pid} for arm, seed, pid in keys
               if (arm, seed, pid) not in comps]
    answered = [{"arm": arm, "seed": seed, "prompt_id": pid, "finish_reason": c.finish_reason, "content": c.content,
                 "completion_tokens": c.completion_tokens} for (arm, seed, pid), c in sorted(comps.items())]
    write_text_atomic(out / "completions.partial.jsonl", "".join(json.dumps(a) + "\n" for a in answered))
    path = out / "partial.json"
    write_json(path, {"complete": False, "stage": stage,
                      "error": {"type": type(error).__name__, "message": str(error)},
                      "requests": len(keys), "answered": len(comps), "missing": missing,
                      "files": {"completions": "completions.partial.jsonl"}, "config": _config_dict(cfg)})
    return path


def _stop_with_partial(cfg: ServeConfig, keys: list[tuple], comps: dict[tuple, Completion], error: ABError,
                       stage: str) -> None:
    """Write partial.json and re-raise ``error`` (its type kept) with where the partial report is."""
    path = _write_partial(cfg, keys, comps, error, stage)
    raise type(error)(f"{error}\npartial report: {path} ({len(comps)} of {len(keys)} requests answered; "
                      "partial.json lists the missing ones; no report.json)") from error


def run_serve_ab(cfg: ServeConfig) -> ServeABReport:
    """Run the server-level A/B and write report.json, summary.md, completions.jsonl and PNGs
    into cfg.out_dir. Raises ABError subclasses on environment problems."""
    if len(cfg.arms) != 2:
        raise ABError(f"serve A/B needs exactly two --arm NAME=URL, got {len(cfg.arms)}")
    if cfg.arms[0][0] == cfg.arms[1][0]:
        raise ABError(f"the two arms need different names, both are {cfg.arms[0][0]!r}")
    if cfg.seeds < 1:
        raise ABError(f"--seeds must be >= 1, got {cfg.seeds}")
    require_httpx()  # a core install: one line naming the package, the output directory untouched
    try:  # before any request: a run of hours must not fail when it writes its report
        check_output_dir(cfg.out_dir, "--out")
    except OutputPathError as e:
        raise InputError(str(e)) from None
    pset = load_prompt_set(cfg.prompts, cfg.prompts_format, choice_seed=cfg.choice_seed,
                           template_path=cfg.prompt_template, limit=cfg.limit)
    prompts = pset.prompts
    clients = [ChatClient(n, u, timeout_s=cfg.timeout_s, retries=cfg.retries, backoff_s=cfg.backoff_s)
               for n, u in cfg.arms]
    keys = [(c.name, s, p.id) for s in range(cfg.seeds) for c in clients for p in prompts]
    comps: dict[tuple, Completion] = {}
    arms_info: dict[str, dict] = {}
    try:
        for c in clients:  # reachability check before queueing hundreds of requests
            served = c.models()
            model = cfg.model or (served[0] if served else None)
            if model is None:
                raise ABError(f"arm '{c.name}' ({c.base_url}) serves no model and --model was not given")
            arms_info[c.name] = {"url": c.base_url, "model": model, "served_models": served}
    except ABError as e:
        _stop_with_partial(cfg, keys, comps, e, "pre-flight")

    jobs = [(c, _payload(cfg, arms_info[c.name]["model"], p, s), (c.name, s, p.id))
            for s in range(cfg.seeds) for c in clients for p in prompts]
    t0 = time.perf_counter()
    try:
        _run_all(jobs, cfg.concurrency, cfg.progress, comps)
    except ABError as e:
        _stop_with_partial(cfg, keys, comps, e, "requests")
    wall = time.perf_counter() - t0

    results: dict[tuple, RequestResult] = {}
    by_id = {p.id: p for p in prompts}  # ids are unique (load_prompt_set)
    for (arm, seed, pid), comp in comps.items():
        gr = grade(by_id[pid], comp.content, comp.reasoning_content, comp.finish_reason)  # the one grading rule
        start = comp.started_s - t0  # the span speed.py's aggregate rate divides by
        results[(arm, seed, pid)] = RequestResult(
            arm, seed, pid, comp.finish_reason, gr.answer, gr.answer_source, gr.correct, gr.truncated,
            comp.completion_tokens, len(comp.content or ""), len(comp.reasoning_content or ""), comp.latency_s,
            start, start + comp.latency_s)

    a, b = clients[0].name, clients[1].name
    # Greedy pass (seed 0): answer agreement and token-level agreement.
    per_prompt, agreements, matches = [], [], 0
    missing_logprobs = {a: 0, b: 0}
    for p in prompts:
        ca, cb = comps[(a, 0, p.id)], comps[(b, 0, p.id)]
        ka = final_answer_key(ca.content, p, ca.reasoning_content)
        kb = final_answer_key(cb.content, p, cb.reasoning_content)
        matches += ka == kb
        row = {"id": p.id, "kind": p.kind, "gold": p.answer, **({"choice_order": list(p.choice_order)}
                                                                 if p.choice_order else {}),
               f"answer_{a}": results[(a, 0, p.id)].answer,
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
    # "prompts" after the token summary, whose own "prompts" counts those with logprobs on both arms.
    tok = summarize_agreements(agreements)
    tok["prompts_compared_by_tokens"] = tok.pop("prompts")
    greedy = {"baseline_arm": a, "other_arm": b, "prompts": len(prompts),
              "final_answer_match_rate": matches / len(prompts),
              "prompts_without_logprobs": missing_logprobs, **tok}

    # Accuracy pass: per arm, per seed, graded prompts only.
    graded = [p for p in prompts if p.answer is not None]
    accuracy: dict[str, dict] = {}
    grades: dict[str, tuple] = {}  # arm -> (correct [Q, N], sem) of all graded prompts
    for c in clients:
        rs = [results[(c.name, s, p.id)] for s in range(cfg.seeds) for p in prompts]
        arm_acc = {"requests": len(rs),
                   "truncation_rate": sum(r.truncated for r in rs) / len(rs),
                   "answer_from_reasoning_rate": sum(r.answer_source == "reasoning_content" for r in rs) / len(rs),
                   "mean_latency_s": sum(r.latency_s for r in rs) / len(rs)}
        for subset, ps in (("all_graded", graded), ("mc", [p for p in graded if p.kind == "mc"]),
                           ("arith", [p for p in graded if p.kind == "arith"])):
            if not ps:
                continue
            grid = [[results[(c.name, s, p.id)] for s in range(cfg.seeds)] for p in ps]  # [Q][N]
            correct = [[float(bool(r.correct)) for r in row] for row in grid]
            st = arm_accuracy(correct, [[r.answer for r in row] for row in grid], [p.answer for p in ps],
                              [[r.truncated for r in row] for row in grid])
            n = len(ps) * cfg.seeds
            wrong = sum((not r.correct) and not r.truncated and r.answer is not None for row in grid for r in row)
            noans = sum(r.answer is None and not r.truncated for row in grid for r in row)
            mean, std = pass_at_1(st.per_seed)
            arm_acc[subset] = {"prompts": len(ps), "seeds": cfg.seeds, "pass@1": mean, "std": std, "sem": st.sem,
                               "per_seed": st.per_seed, "majority": st.majority,
                               "metric_names": {"pass@1": f"pass@1[avg-of-{cfg.seeds}]",
                                                "majority": f"majority@{cfg.seeds}"},
                               "wrong_rate": wrong / n, "truncated_rate": st.truncated_rate, "no_answer_rate": noans / n,
                               "empty_answer_rate": st.empty_answer_rate, "answered_rate": 1 - st.empty_answer_rate}
            if subset == "all_graded":
                grades[c.name] = (correct, st.sem)
        accuracy[c.name] = arm_acc
    comparison = None
    if len(grades) == 2 and all(accuracy[x]["all_graded"]["answered_rate"] == 0 for x in grades):
        # Every score is 0 by rule, none measured: a "no difference resolved" verdict would read as a result.
        pass
    elif len(grades) == 2:
        comparison = compare(a, b, grades[a][0], grades[b][0], grades[a][1], grades[b][1],
                             resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed).to_dict()
        comparison["subset"] = "all_graded"
    speed = {}
    for c in clients:
        rs = [results[(c.name, s, p.id)] for s in range(cfg.seeds) for p in prompts]
        speed[c.name] = arm_speed([r.latency_s for r in rs], [r.completion_tokens for r in rs],
                                  [r.start_s for r in rs], [r.end_s for r in rs]).to_dict()

    verdict = decide([(p.id, comps[(a, 0, p.id)].tokens, comps[(b, 0, p.id)].tokens) for p in prompts],
                     cfg.dlogprob_bound).to_dict()
    cfg_d = _config_dict(cfg)
    cfg_d["prompt_set"] = pset.source
    cfg_d["wall_s"] = wall
    report = ServeABReport(cfg_d, arms_info, greedy, accuracy, per_prompt, DEFINITIONS, pset.describe(), comparison,
                           speed, verdict=verdict)
    _write_serve_outputs(report, cfg, comps, results)
    return report


def summary_markdown(rep: ServeABReport) -> str:
    """The summary.md text (also printed by the CLI)."""
    g = rep.greedy
    a, b = g["baseline_arm"], g["other_arm"]
    lines = [f"# Serve A/B: {a} vs {b}", "",
             f"Prompts: {g['prompts']} ({rep.config['prompt_set']}, {rep.dataset.get('format')}, template "
             f"{rep.dataset.get('prompt_template', {}).get('source')}), seeds: {rep.config['seeds']}, "
             f"max_tokens: {rep.config['max_tokens']}, reasoning_effort: {rep.config['reasoning_effort']}", "",
             "## Greedy pass (seed 0)", "",
             markdown_table(["metric", "value"], [
                 ["final-answer match rate", fmt(g["final_answer_match_rate"], ".3f")],
                 ["identical token streams", f"{g['identical_token_streams']}/{g['prompts_compared_by_tokens']}"],
                 ["median first-divergence position", g["median_first_divergence"]],
                 ["top-1 token agreement (aligned positions)", fmt(g["top1_agreement"], ".4f")],
                 ["mean abs delta logprob", fmt(g["mean_abs_dlogprob"], ".3g")],
                 ["max abs delta logprob", fmt(g["max_abs_dlogprob"], ".3g")],
                 ["mean top-k KL (nats, approx.)", fmt(g["mean_topk_kl"], ".3g")],
                 ["aligned positions", g["aligned_positions"]],
             ]), ""] + ([verdict_markdown(rep.verdict)] if rep.verdict else []) + ["## Accuracy (pass@1 over seeds)", ""]
    lines += _accuracy_lines(rep)
    c = rep.comparison
    if c is not None:
        m = c["mcnemar"]
        ci = c["ci95_pp"]
        lines += ["", f"## {c['arm_b']} vs {c['arm_a']} (paired, {c['questions']} questions x {c['seeds']} seeds)", "",
                  f"**Verdict: {c['verdict']}**", "",
                  markdown_table(["metric", "value"], [
                      ["difference (B - A)", f"{c['diff_pp']:+.2f} pp"],
                      ["paired SE", _pp(c["se_pp"])],
                      ["sigmas (difference / paired SE)", fmt(c["sigmas"], ".2f")],
                      ["unpaired SE sqrt(SEM_A^2 + SEM_B^2)", _pp(c["unpaired_se_pp"])],
                      ["95% bootstrap CI over questions", "–" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}] pp"],
                      ["bootstrap", f"{c['bootstrap']['resamples']} resamples, seed {c['bootstrap']['seed']}"],
                      [f"greedy: only {c['arm_a']} right / only {c['arm_b']} right", f"{m['a_only']} / {m['b_only']}"],
                      ["greedy: both right / both wrong", f"{m['both']} / {m['neither']}"],
                      ["exact McNemar p (greedy)", fmt(m["p_value"], ".3g")],
                  ]), "",
                  "A gap on a small benchmark can be a prompt artefact (template, answer format, extraction) rather "
                  "than the backend: read the interval, and reproduce with the model card's harness before "
                  "concluding."]
    if rep.speed:
        srows = []
        for arm, sp in rep.speed.items():
            lat, tps = sp["latency_s"], sp["tokens_per_s_per_request"] or {}
            srows.append([arm, sp["requests"], fmt(lat["p50"], ".3g"), fmt(lat["p90"], ".3g"), fmt(lat["p99"], ".3g"),
                          fmt(tps.get("p50"), ".4g"), fmt(sp["aggregate_tokens_per_s"], ".4g"),
                          sp["total_completion_tokens"], fmt(sp["wall_span_s"], ".3g")])
        lines += ["", "## Speed (the same requests)", "",
                  markdown_table(["arm", "requests", "latency p50 s", "p90 s", "p99 s", "tokens/s per request p50",
                                  "aggregate tokens/s", "completion tokens", "wall span s"], srows)]
    lines += ["", "Definitions: see report.json `definitions`.", ""]
    return "\n".join(lines)


def _accuracy_lines(rep: ServeABReport) -> list[str]:
    """The accuracy section's text below its heading: the table, or why nothing was graded."""
    n = rep.config["seeds"]
    graded = {arm: acc["all_graded"] for arm, acc in rep.accuracy.items() if "all_graded" in acc}
    if not graded:
        return ["Nothing was graded: no prompt has a gold answer (free prompts), so there is no accuracy and no "
                "comparison; the greedy pass above is the whole A/B."]
    rows = []
    for arm, acc in rep.accuracy.items():
        for subset in ("all_graded", "mc", "arith"):
            if subset in acc:
                s = acc[subset]
                rows.append([arm, subset, s["prompts"], f"{100*s['pass@1']:.2f}", f"{100*s['std']:.2f}", _pct(s["sem"]),
                             f"{100*s['majority']:.2f}", f"{100*s['wrong_rate']:.2f}", f"{100*s['truncated_rate']:.2f}",
                             f"{100*s['no_answer_rate']:.2f}", f"{100*s['empty_answer_rate']:.2f}"])
    lines = [f"pass@1[avg-of-{n}] and majority@{n} over {n} seed(s) (seed 0 greedy); SEM = std over seeds / "
             f"sqrt({n}). Grading: a request scores by its extracted answer, whatever its finish_reason; none "
             "scores 0 (report.json `definitions.grading`)."]
    lines += ["", markdown_table(["arm", "set", "prompts", "pass@1 %", "std %", "SEM %", f"majority@{n} %", "wrong %",
                                  "truncated %", "no answer %", "empty answer %"], rows)]
    notes = []
    for arm, s in graded.items():
        if s["truncated_rate"] == 1:
            notes.append(f"{arm}: every graded request was truncated (finish_reason \"length\", --max-tokens "
                         f"{rep.config['max_tokens']})" + ("; none gave an answer before the cut." if s["answered_rate"] == 0
                                                           else "; graded on the answers given before the cut."))
        elif s["answered_rate"] == 0:
            notes.append(f"{arm}: no graded request gave an extractable answer.")
    if all(s["answered_rate"] == 0 for s in graded.values()):
        notes.append("**Nothing was graded: no request of " + ("either arm" if len(graded) > 1 else "the arm") +
                     " gave an answer, so every score above is 0 by rule, not a measured accuracy, and no comparison "
                     "is made.**" + (" Raise --max-tokens." if any(s["truncated_rate"] > 0 for s in graded.values())
                                     else ""))
    if notes:
        lines += ["", *notes]
    return lines


def _pct(x: float | None) -> str:
    """A fraction as percent (2 decimals), or an en dash."""
    return "–" if x is None else f"{100 * x:.2f}"


def _pp(x: float | None) -> str:
    """Percentage points (2 decimals), or an en dash."""
    return "–" if x is None else f"{x:.2f} pp"


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
            path, g["first_divergence_positions"], g["identical_token_streams"], g["prompts_compared_by_tokens"],
            f"greedy first divergence: {g['other_arm']} vs {g['baseline_arm']}"))}
        if all("all_graded" in rep.accuracy[x] for x in arms):
            acc = [rep.accuracy[x]["all_graded"] for x in arms]
            c = rep.comparison
            todo["accuracy_plot"] = ("accuracy.png", lambda path: plots.accuracy_bars(
                path, arms, [x["pass@1"] for x in acc], [x["sem"] for x in acc],
                [rep.accuracy[x]["truncation_rate"] for x in arms],
                f"pass@1[avg-of-{cfg.seeds}] per arm (+-1 SEM over seeds)",
                diff=None if c is None else (c["diff_pp"], c["ci95_pp"], c["verdict"])))
        drawn, skipped = plots.draw_all(out, todo)
        rep.files.update(drawn)
        if skipped:
            rep.files["plots_skipped"] = skipped
        write_json(out / "report.json", rep.to_dict())
    for stale in ("partial.json", "completions.partial.jsonl"):  # of an earlier, failed run into this directory
        (out / stale).unlink(missing_ok=True)
