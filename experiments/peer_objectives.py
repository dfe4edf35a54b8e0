"""offline-rec's presets and overrides against the peers' OWN code (verl 0.9.1, Trinity-RFT 0.6.0) on float64 batches.

    pip download --no-deps verl==0.9.1 trinity-rft==0.6.0 -d WHEELS
    for w in WHEELS/*.whl; do unzip -q -o "$w" -d PEERS; done
    python -m experiments.peer_objectives --peers PEERS

For each pair it prints the largest absolute difference of the gradient with respect to the policy's
log-probs (and of the advantages, for the advantage functions) between offline-rec and the peer, with
and without the override docs/paper.md names ("Where do the defaults differ from the
authors' code, and how do I get theirs?"): icepop-seq against verl's sequence-level IS with an IcePop
band, grpo + dual-clip against Trinity's PPO loss, sapo-gate against Trinity's SAPO, kl_estimator k2 against
Trinity's K2 KL loss, population_std against Trinity's REC advantage, and how verl and Trinity treat a group of one.

The peers are imported from --peers (their unpacked wheels, added as a site directory), not installed: the
packages they import at module level and this machine lacks (ray, omegaconf, ...) are stood in for by empty
modules. The functions measured here never call them; a stand-in that were called would fail the run, not fake
a value.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import math
import site
import sys
from unittest import mock

STAND_INS = ("ray", "omegaconf", "vllm", "tensordict", "codetiming", "hydra", "jsonlines", "sqlalchemy", "openai",
             "math_verify", "latex2sympy2_extended", "word2number", "fire", "sortedcontainers", "wandb", "swanlab",
             "mlflow", "agentscope", "data_juicer", "loguru", "mcp", "flask", "fastapi", "uvicorn", "aiohttp",
             "psutil", "numpy_financial")
"""Top-level packages the peers import at module level; stood in for only where not installed."""


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the missing packages in `names` give mock modules (consulted after the real finders)."""

    def __init__(self, names):
        self.names = {name for name in names if importlib.util.find_spec(name) is None}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


def batch(seed: int = 0, rows: int = 12, width: int = 6):
    """A float64 batch: log-probs [B, T], behavior log-probs (log rho ~ N(0, 0.25^2)), advantages [B], mask [B, T]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(width)[None, :] < torch.randint(2, width + 1, (rows, 1), generator=g)  # [B, T]
    logp = torch.where(mask, -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2 - 0.05, 0.0)
    blogp = torch.where(mask, logp - torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.25, 0.0)
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    return logp, blogp, advantages, mask


def gradient(loss_of, logp, mask):
    """d loss / d logp on the completion tokens, and the loss."""
    import torch

    leaf = logp.clone().requires_grad_()
    loss = loss_of(leaf)
    loss.backward()
    return torch.where(mask, leaf.grad, 0.0), loss.item()


def compare(name: str, ours, theirs, logp, mask) -> dict:
    grad_ours, _ = gradient(ours, logp, mask)
    grad_theirs, _ = gradient(theirs, logp, mask)
    row = {"pair": name, "max_grad_diff": float((grad_ours - grad_theirs).abs().max())}
    print(f"{name:58s} max |grad diff| {row['max_grad_diff']:.1e}")
    return row


def run() -> list[dict]:
    import torch
    from trinity.algorithm.advantage_fn.rec_advantage import RECGroupedAdvantage
    from trinity.algorithm.kl_fn.kl_fn import K2Fn
    from trinity.algorithm.policy_loss_fn.ppo_policy_loss import PPOPolicyLossFn
    from trinity.algorithm.policy_loss_fn.sapo_policy_loss import SAPOPolicyLossFn
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    from offline_rec.loss.advantages import group_advantages
    from offline_rec.loss.objective import Objective
    from offline_rec.loss.policy_loss import TokenBatch, policy_loss
    from offline_rec.loss.presets import PRESETS, get_objective

    logp, blogp, advantages, mask = batch()
    rows, width = logp.shape
    count = mask.sum()
    token_advantages = advantages[:, None].expand(rows, width)

    def preset(spec, behavior=blogp, adv=advantages):
        return lambda leaf: policy_loss(spec, TokenBatch(leaf, behavior, adv, mask))[0]

    results = []
    # verl: sequence-level IS weights with an IcePop band (rollout_is="sequence", threshold "0.5_2.0"), times the
    # PPO loss of one update per batch (old = current: ratio 1 carrying gradient), token-mean
    def verl_sequence_is(leaf):
        weights, _ = compute_rollout_correction_weights(leaf.detach() - blogp, mask.double(), rollout_is="sequence",
                                                        rollout_is_threshold="0.5_2.0")
        return (-advantages[:, None] * torch.exp(leaf - leaf.detach()) * weights * mask).sum() / count

    results.append(compare("icepop-seq vs verl sequence IS 0.5_2.0", preset(PRESETS["icepop-seq"].objective),
                           verl_sequence_is, logp, mask))

    # Trinity's PPO loss (its grpo, dapo) with its defaults: dual clip c = 3; one token with rho = 4 and A < 0
    far, adv_far = blogp.clone(), advantages.clone()
    far[0, 0], adv_far[0] = logp[0, 0] - math.log(4.0), -1.0
    ppo = PPOPolicyLossFn(**PPOPolicyLossFn.default_args())

    def trinity_ppo(leaf):
        return ppo(leaf, far, mask.double(), adv_far[:, None].expand(rows, width))[0]

    results.append(compare("grpo dual_clip_c=3 vs Trinity PPO", preset(get_objective("grpo", dual_clip_c=3.0), far,
                                                                     adv_far), trinity_ppo, logp, mask))
    results.append(compare("grpo (default) vs Trinity PPO", preset(PRESETS["grpo"].objective, far, adv_far),
                           trinity_ppo, logp, mask))

    sapo = SAPOPolicyLossFn(**SAPOPolicyLossFn.default_args())

    def trinity_sapo(leaf):
        return sapo(leaf, blogp, mask.double(), token_advantages)[0]

    gate = get_objective("sapo", weight="sapo-gate", aggregation="token-mean")
    results.append(compare("sapo weight=sapo-gate token-mean vs Trinity SAPO", preset(gate), trinity_sapo, logp, mask))
    results.append(compare("sapo (default) vs Trinity SAPO", preset(PRESETS["sapo"].objective), trinity_sapo, logp,
                           mask))

    initial = torch.where(mask, logp + torch.randn(rows, width, generator=torch.Generator().manual_seed(1),
                                                   dtype=torch.float64) * 0.3, 0.0)

    def trinity_k2(leaf):
        return K2Fn(kl_coef=0.001).calculate_kl_loss(leaf, initial, mask.double(), "token-mean")[0]

    for estimator in ("k2", "k3"):
        results.append(compare(f"kl_to_initial 0.001 {estimator} vs Trinity K2 0.001",
                               lambda leaf, e=estimator: policy_loss(
                                   Objective(kl_to_initial=0.001, kl_estimator=e),
                                   TokenBatch(leaf, leaf.detach(), torch.zeros(rows, dtype=torch.float64), mask,
                                              initial), num_tokens=count)[0],
                               trinity_k2, logp, mask))

    class Experience:  # the two fields RECGroupedAdvantage reads
        def __init__(self, reward):
            self.reward, self.action_mask = reward, torch.ones(3)

    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    experiences, _ = RECGroupedAdvantage(std_normalize=True).calculate_group_advantage(
        "g", [Experience(r) for r in rewards])
    trinity = torch.tensor([float(e.advantages[0]) for e in experiences], dtype=torch.float64)
    for population in (True, False):
        spec = get_objective("rec-oneside-nois", std_normalize=True, population_std=population)
        ours, _ = group_advantages(spec, torch.tensor(rewards, dtype=torch.float64), [0] * len(rewards))
        difference = float((ours - trinity).abs().max())
        results.append({"pair": f"REC advantage population_std={population}", "max_advantage_diff": difference})
        print(f"{'REC advantage std_normalize, population_std=' + str(population) + ' vs Trinity':58s} "
              f"max |adv diff|  {difference:.1e}")

    # a group of one: Trinity's REC advantage, verl's GRPO advantage, offline-rec's group baseline
    try:
        RECGroupedAdvantage().calculate_group_advantage("g", [Experience(1.0)])
        trinity_singleton = "no error"
    except Exception as exc:  # what it raises is the measurement
        trinity_singleton = f"{type(exc).__name__}: {exc}"
    verl_singleton, _ = core_algos.compute_grpo_outcome_advantage(
        torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), __import__("numpy").array(["a"]))
    ours_singleton = float(group_advantages(PRESETS["grpo"].objective, torch.tensor([1.0]), [0])[0][0])
    results.append({"pair": "group of one, reward 1", "trinity_rec": trinity_singleton,
                    "verl_grpo": float(verl_singleton[0, -1]), "offline_rec_grpo": ours_singleton})
    print(f"group of one, reward 1: Trinity REC -> {trinity_singleton}; verl GRPO -> {float(verl_singleton[0, -1])}; "
          f"offline-rec grpo -> {ours_singleton}")
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True, help="folder holding the unpacked verl and trinity-rft wheels")
    args = parser.parse_args(argv)
    site.addsitedir(args.peers)
    sys.meta_path.append(_StandIn(STAND_INS))
    return run()


if __name__ == "__main__":
    main()
