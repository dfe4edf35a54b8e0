"""The model card (README.md) of a trained policy pushed to the Hub: algorithm and hyper-parameters, training
data (linked where it is on the Hub), evaluation, usage and the training configuration.

It starts with the YAML front matter the Hub reads (library, tags, datasets, base model). Rendering is a
pure function of its arguments; `hub/transfer.py` uploads it.
"""

from __future__ import annotations

import json

from offline_rec.dataset.card import NOT_RECORDED, as_prose, with_front_matter
from offline_rec.dataset.locations import hub_dataset_reference

MODEL_TAGS = ["offline-rl", "rl", "reinforce", "offline-rec"]


def _value_table(header: str, values: dict) -> str:
    rows = "\n".join(f"| `{key}` | {as_prose(value)} |" for key, value in values.items())
    return f"| {header} | value |\n|---|---|\n{rows}"


_USAGE = {
    "transformers": (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        'model = AutoModelForCausalLM.from_pretrained("{repo_id}")'
    ),
    "peft": (  # a LoRA adapter: peft loads its base model from adapter_config.json
        "from peft import AutoPeftModelForCausalLM\n"
        'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")'
    ),
}


def render_model_card(
    repo_id: str,
    *,
    algorithm: dict,
    training_data: list[str],
    eval_summary: dict | None,
    config: dict,
    base_model: str | None = None,
    library_name: str = "transformers",
) -> str:
    """The README.md of a trained policy: algorithm and hyper-parameters, training data, evaluation, config."""
    import yaml

    references = [hub_dataset_reference(source) for source in training_data]
    hub_ids = list(dict.fromkeys(ref[0] for ref in references if ref))
    front: dict = {"library_name": library_name, "tags": list(MODEL_TAGS)}
    if hub_ids:
        front["datasets"] = hub_ids
    if base_model:
        front["base_model"] = base_model
    name = algorithm.get("name") or config.get("algorithm") or NOT_RECORDED
    hyper = {key: value for key, value in algorithm.items() if key != "name"}
    data_lines = []
    for source, ref in zip(training_data, references):
        if ref:
            repo, revision = ref
            data_lines.append(
                f"- [{repo}](https://huggingface.co/datasets/{repo})"
                + (f" at revision `{revision}`" if revision else "")
            )
        else:
            data_lines.append(f"- local dataset `{source}` (not on the Hub)")
    evaluation = _value_table("metric", eval_summary) if eval_summary else "No evaluation was run for this checkpoint."
    usage = _USAGE[library_name].format(repo_id=repo_id)
    plain_config = json.loads(json.dumps(config, default=str))  # paths, enums, ... as strings: safe YAML
    config_yaml = yaml.safe_dump(plain_config, sort_keys=False, allow_unicode=True, default_flow_style=False).rstrip()
    body = f"""# {repo_id}

A policy trained offline with offline-rec from logged trajectories and their behavior
log-probabilities, with the group-relative REINFORCE loss `{name}`.
Base model: {as_prose(base_model or config.get('model'))}.

## Algorithm

Preset `{name}`; its hyper-parameters as trained:

{_value_table("hyper-parameter", hyper) if hyper else "(no hyper-parameters recorded)"}

## Training data

{chr(10).join(data_lines) or "- not recorded"}

## Evaluation

{evaluation}

## Usage

```python
{usage}
```

## Training configuration

```yaml
{config_yaml}
```
"""
    return with_front_matter(front, body)
