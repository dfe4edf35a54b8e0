"""Train's old option names and values, read as the new ones with one deprecation line each.

Before the objective was a group of train's options, its fields were set through `algorithm_overrides` (a YAML
mapping) or `--set algorithm.FIELD=VALUE`, and five bounds had two ways to be said. Old configuration files, old
command lines and the config.yaml of an old run still work: `translate` turns them into today's keys, with the
same meaning, and returns one line per old key it met:

    algorithm_overrides: {k: v}, --set algorithm.k=v   ->  k: v
    is_cap: C                                         ->  weight_max: C   (0: off)
    dual_clip_negatives: true, clip: dual-clip        ->  dual_clip_c: c  (clip one-side for the latter)
    icepop_mask: true, clip: icepop                   ->  mask_low / mask_high  (clip none for the latter)
    clip: icepop-seq, weight: seq-is                  ->  ratio_level: row, weight: is
    weight: tis                                       ->  weight: is, weight_min / weight_max = 1 -+ eps_*_prime
    weight: cispo                                     ->  weight: is, weight_min / weight_max = 1 -+ eps_*

A bound the old preset did not read (mask_low on a preset without IcePop's band, say) had no effect then: it is
dropped with its line rather than switched on. No torch here.
"""

from __future__ import annotations

import math

from offline_rec.errors import UserError
from offline_rec.loss.presets import PRESETS

OVERRIDES_KEY = "algorithm_overrides"
SET_PREFIX = "algorithm."

# What the old presets chose where today's differ, and the old defaults of the fields their choices read.
_OLD_PRESETS = {"dual-clip": {"clip": "dual-clip"}, "icepop": {"clip": "icepop"},
                "icepop-seq": {"clip": "icepop-seq", "weight": "seq-is", "mask_high": 2.0},
                "cispo": {"weight": "cispo", "eps_low": 1.0, "eps_high": 0.28}}
_OLD_DEFAULTS = {"eps_low": 0.2, "eps_high": 0.2, "eps_low_prime": 0.6, "eps_high_prime": 2.0, "dual_clip_c": 3.0,
                 "mask_low": 0.5, "mask_high": 5.0}
_OLD_KEYS = {
    "is_cap": "write weight_max (off: inf, was 0)",
    "dual_clip_negatives": "write dual_clip_c (off: inf)",
    "icepop_mask": "write mask_low and mask_high (off: 0 and inf)",
}
_OLD_VALUES = {("clip", "dual-clip"): "clip one-side with dual_clip_c", ("clip", "icepop"): "mask_low / mask_high",
               ("clip", "icepop-seq"): "ratio_level row with mask_low / mask_high",
               ("weight", "seq-is"): "weight is with ratio_level row",
               ("weight", "tis"): "weight is with weight_min / weight_max = 1 - eps_low_prime / 1 + eps_high_prime",
               ("weight", "cispo"): "weight is with weight_min / weight_max = 1 - eps_low / 1 + eps_high"}


def translate(layer: dict, algorithm: str | None, where: str) -> tuple[dict, list[str]]:
    """`layer` (a YAML mapping or the --set layer, flat keys) with its old keys and values turned into today's, and
    one deprecation line per old key or value; `algorithm`: the preset the layer applies to (the old presets read
    some fields that today's do not)."""
    layer, lines, legacy = dict(layer), [], {}
    if OVERRIDES_KEY in layer:
        legacy.update(layer.pop(OVERRIDES_KEY) or {})
        lines.append(f"deprecated: {OVERRIDES_KEY} in {where}: write its keys at the top level (e.g. eps_low: 0.6)")
    for key in [key for key in layer if key.startswith(SET_PREFIX)]:
        legacy[key[len(SET_PREFIX):]] = layer.pop(key)
        lines.append(f"deprecated: --set {key} in {where}: write --set {key[len(SET_PREFIX):]}=...")
    for key in [key for key in layer if key in _OLD_KEYS or (key, str(layer[key])) in _OLD_VALUES]:
        legacy[key] = layer.pop(key)
    if not legacy:
        return layer, lines
    return {**layer, **_objective(legacy, algorithm, where, lines)}, lines


def _objective(legacy: dict, algorithm: str | None, where: str, lines: list[str]) -> dict:
    """Today's objective keys for the old ones in `legacy` (see the module docstring)."""
    for key, value in legacy.items():
        if key in _OLD_KEYS:
            lines.append(f"deprecated: {key} in {where}: {_OLD_KEYS[key]}")
        elif (key, str(value)) in _OLD_VALUES:
            lines.append(f"deprecated: {key} {value} in {where}: now {_OLD_VALUES[key, str(value)]}")
    today = PRESETS[algorithm].objective if algorithm in PRESETS else None
    preset = {"clip": today.clip, "weight": today.weight} if today else {}
    seen = {**_OLD_DEFAULTS, **preset, **_OLD_PRESETS.get(algorithm or "", {}), **legacy}  # what the old objective read
    clip = str(seen.get("clip", "none"))
    new = {key: value for key, value in legacy.items() if key not in _OLD_KEYS}
    if clip == "dual-clip" or _true(legacy.get("dual_clip_negatives")):
        new["dual_clip_c"] = seen["dual_clip_c"]
        if str(legacy.get("clip")) == "dual-clip":
            new["clip"] = "one-side"
    elif new.pop("dual_clip_c", None) is not None:
        lines.append(f"deprecated: dual_clip_c in {where} had no effect without dual_clip_negatives: dropped")
    if clip in ("icepop", "icepop-seq") or _true(legacy.get("icepop_mask")):
        new.update(mask_low=seen["mask_low"], mask_high=seen["mask_high"])
        if str(legacy.get("clip")) in ("icepop", "icepop-seq"):
            new["clip"] = "none"
    else:
        for key in ("mask_low", "mask_high"):
            if new.pop(key, None) is not None:
                lines.append(f"deprecated: {key} in {where} had no effect without icepop_mask: dropped")
    _weight(legacy, seen, new, where)
    if "is_cap" in legacy:
        cap = float(legacy["is_cap"])
        new["weight_max"] = cap if cap > 0 else math.inf
    return new


def _weight(legacy: dict, seen: dict, new: dict, where: str) -> None:
    """The old weights tis, cispo, seq-is (and the clip icepop-seq) as weight is with its bounds or ratio level."""
    clip, weight = str(seen.get("clip", "none")), str(seen.get("weight", "none"))
    if clip == "icepop-seq" or weight == "seq-is":
        if clip == "icepop-seq" and weight not in ("seq-is", "none"):
            raise UserError(f"{where}: icepop-seq with weight {weight} (each token's own ratio under the row's band) "
                            "is no longer offered: ratio_level row reads the row's ratio in the band and the weight "
                            "alike; leave weight out (the preset weighs by the row's ratio)")
        if weight == "seq-is" and clip not in ("icepop-seq", "none"):
            raise UserError(f"{where}: weight seq-is under clip {clip} is no longer offered: ratio_level row would "
                            "clip on the row's ratio too")
        new.update(ratio_level="row", **({"weight": "is"} if weight == "seq-is" else {}))
    if weight == "tis":
        new.update(weight="is", weight_min=1 - float(seen["eps_low_prime"]),
                   weight_max=1 + float(seen["eps_high_prime"]))
    elif weight == "cispo" and ("weight" in legacy or {"eps_low", "eps_high"} & legacy.keys()):
        new.update(weight="is", weight_min=1 - float(seen["eps_low"]), weight_max=1 + float(seen["eps_high"]))
        if clip == "none":  # the band was the weight's alone
            new.pop("eps_low", None)
            new.pop("eps_high", None)


def _true(value) -> bool:
    return str(value).strip().lower() in ("true", "yes", "on", "1")
