"""Rich tables for the terminal: validation reports, dataset descriptions, evaluation summaries."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from offline_rec.dataset.validate import ERROR, Report


def print_validation(console: Console, report: Report) -> None:
    if report.problems:
        # Paths, group ids and messages are user data: escaped, so "[...]" in them prints as is.
        table = Table(title=f"problems in {escape(report.path)}")
        for col in ("severity", "kind", "where", "problem"):
            table.add_column(col)
        for p in report.problems:
            style = "red" if p.severity == ERROR else "yellow"
            table.add_row(f"[{style}]{p.severity}[/{style}]", p.code, escape(p.location), escape(p.message))
        console.print(table)
        hidden = sum(report.counts.values()) - len(report.problems)
        if hidden:
            console.print(f"... and {hidden} more of the same kinds (counts by kind: --json)")
    verdict = "[green]valid[/green]" if report.ok else "[red]INVALID[/red]"
    console.print(
        f"{verdict}: {report.rows_checked} rows, {report.groups_checked} groups checked; "
        f"{report.errors} error(s), {report.warnings} warning(s)"
    )


def key_value_table(title: str, items: dict) -> Table:
    table = Table(title=escape(title), show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in items.items():
        table.add_row(escape(str(k)), escape(_fmt(v)))
    return table


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    return str(v)


def _signal_rows(signal: dict | None) -> dict:
    """inspect's lines on which baselines give the data a learning signal (rows with a non-zero advantage)."""
    if not signal:
        return {}
    shares = signal["signal_share_by_baseline"]
    return {
        "groups of one response": signal["singleton_groups"],
        "rows with signal, by baseline": ", ".join(
            f"{name} {n} ({shares[name]:.1%})" for name, n in signal["signal_rows_by_baseline"].items()),
        "baselines with signal": ", ".join(signal["supported_baselines"]) or "none",
        "advice": signal["advice"],
    }


def _recipe_rows(recipe: dict | None) -> dict:
    """inspect's lines on the recipe measured best for data of this shape (dataset/recipe_advice.py)."""
    if not recipe:
        return {}
    return {
        f"recipe measured for {recipe['regime']}": f"offline-rec train {recipe['train_options']}",
        "what it measured": f"{recipe['measured']} ({recipe['evidence']})",
    }


def print_description(console: Console, stats: dict) -> None:
    console.print(key_value_table(
        f"dataset {stats['path']}",
        {
            "schema version": stats["schema_version"],
            "complete": stats["complete"],
            "task": stats["task"].get("name"),
            "reward function": stats["task"].get("reward_function"),
            "shards": stats["shards"],
            "rows": stats["rows"],
            "groups": stats["groups"],
            "group sizes (size: groups)": stats.get("group_size_histogram", {}),
            "tokens": stats.get("tokens", {}),
            "prompt length": stats.get("prompt_length", {}),
            "completion length": stats.get("completion_length", {}),
            "groups with all-equal rewards (no signal under the group baseline)": (
                f"{stats.get('all_equal_reward_groups', 0)} "
                f"({stats.get('all_equal_reward_group_fraction', 0.0):.1%} of the groups)"
            ),
            **_signal_rows(stats.get("signal")),
            **_recipe_rows(stats.get("recipe")),
            "finish reasons": stats.get("finish_reasons", {}),
            "policy versions (version: rows)": stats.get("policy_versions", {}),
        },
    ))
    behaviors = stats.get("behaviors") or {}
    if len(behaviors) > 1:  # logs of several loggers: their rows, rewards and log-probs side by side
        table = Table(title="rows per behavior (importance-weight ESS against a policy: eval --offline)")
        for column in ("behavior", "rows", "reward mean", "mean log-prob per token"):
            table.add_column(column, justify="left" if column == "behavior" else "right")
        for name, row in behaviors.items():
            table.add_row(escape(str(name)), str(row["rows"]), _number(row["reward_mean"]),
                          _number(row["logprob_mean"]))
        console.print(table)
    reward = stats.get("reward")
    if reward:
        console.print(key_value_table("reward", {k: v for k, v in reward.items() if k != "histogram"}))
        if reward.get("histogram"):
            table = Table(title="reward histogram")
            table.add_column("bin")
            table.add_column("count", justify="right")
            table.add_column("")
            peak = max(b["count"] for b in reward["histogram"]) or 1
            for b in reward["histogram"]:
                table.add_row(
                    f"[{b['low']:.3g}, {b['high']:.3g}]", str(b["count"]), "#" * round(30 * b["count"] / peak)
                )
            console.print(table)
    behavior = stats.get("behavior") or {}
    flat = {k: v for k, v in behavior.items() if k != "sampling"}
    flat.update({f"sampling.{k}": v for k, v in (behavior.get("sampling") or {}).items()})
    console.print(key_value_table("behavior provenance", flat))


def _number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def eval_summary_table(summary: dict) -> Table:
    """The table of an evaluation summary (rollout or offline), as `offline-rec eval` prints it."""
    metrics = summary["metrics"]
    if summary.get("kind") == "offline":
        percent = f"{summary.get('confidence', 0.95):.0%}"
        table = Table(
            title=escape(f"offline estimate for {summary['model']} ({metrics['n']} logged sequences)"), min_width=70
        )
        table.add_column("quantity")
        table.add_column("value", justify="right")
        table.add_column(f"{percent} bootstrap interval", justify="right")
        for key, label in (("snis", "self-normalized IS estimate"), ("is", "plain IS estimate"),
                           ("logged_reward", "logged mean reward (behavior)")):
            value = metrics["logged_reward_mean"] if key == "logged_reward" else metrics[key]
            interval = (f"[{metrics[f'{key}_ci_low']:.4f}, {metrics[f'{key}_ci_high']:.4f}]"
                        if f"{key}_ci_low" in metrics else "")
            table.add_row(label, f"{value:.4f}", interval)
        table.add_row("effective sample size", f"{metrics['ess']:.1f} ({metrics['ess_fraction']:.1%} of n)", "")
        table.add_row("KL(mu || pi) per sequence", f"{metrics['kl_sequence']:.4f}", "")
        table.add_row("KL(mu || pi) per token", f"{metrics['kl_per_token']:.4f}", "")
        if "ess_token" in metrics:  # the losses' view: token ratios pi/mu, and what each preset's mask removes
            table.add_row("token ESS (share of tokens)", f"{metrics['ess_token']:.1%}", "")
            table.add_row("chi-square(pi || mu) per token", f"{metrics['chi2_token']:.4f}", "")
            for key, value in metrics.items():
                if key.startswith("masked_fraction_"):
                    table.add_row(escape(f"tokens {key.removeprefix('masked_fraction_')}'s mask removes"),
                                  f"{value:.1%}", "")
        behaviors = summary.get("behaviors") or {}
        for name, stats in behaviors.items() if len(behaviors) > 1 else ():
            table.add_row(escape(f"behavior {name}"),
                          escape(f"{stats['rows']} rows, reward {stats['reward_mean']:.4f}, log-prob "
                                 f"{stats['logprob_mean']:.4f}, token ESS {stats['ess']:.1%}, max ratio "
                                 f"{stats['ratio_max']:.4g}"), "")
        return table
    table = Table(
        title=escape(
            f"{summary['task']}: {summary['model']} ({metrics['num_prompts']} prompts x "
            f"{metrics['num_samples']} samples, T={summary['sampling']['temperature']})"
        ),
        min_width=70,
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if key in ("num_prompts", "num_samples"):
            continue
        table.add_row(escape(key), str(value) if isinstance(value, int) else f"{value:.4f}")
    return table


def print_row_stores(console: Console, where: str, stores: list[dict]) -> None:
    """`offline-rec cache list`: one line per row store (`rowcache.list_stores`), then the total."""
    for entry in stores:
        rows = "" if entry["rows"] is None else f", {entry['rows']} rows"
        built_from = f", built from {', '.join(entry['datasets'])}" if entry["datasets"] else ""
        console.print(escape(f"{entry['name']}  {entry['state']}, {entry['bytes'] / 2**20:.1f} MB{rows}, last used "
                             f"{entry['last_used'] or '?'}{built_from}"), soft_wrap=True)
    total = sum(entry["bytes"] for entry in stores) / 2**20
    console.print(escape(f"{len(stores)} row stores, {total:.1f} MB in {where} (`offline-rec cache clear` removes "
                         "them)"), soft_wrap=True)
