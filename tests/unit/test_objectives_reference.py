"""Our objective (rlhf_trainer.algorithms) against an independent implementation of the papers' equations.

The reference side is written here from the equations alone, in the padded (samples x tokens) layout with
masks that OpenRLHF and verl use (ours is packed, per-sample): PPO's clipped surrogate and clipped value
loss (Schulman et al. 2017), GAE (Schulman et al. 2016) as an explicit discounted sum, GRPO's group
normalisation (Shao et al. 2024), REINFORCE++ (Hu 2025), and the k1/k2/k3 KL estimators (Schulman,
"Approximating KL divergence"). Random tensors, ragged lengths (padding), invalid and empty samples.
Nothing from the reference projects is imported, and no function of ours computes a reference value.
"""

from __future__ import annotations

import math

import pytest
import torch
from rlhf_trainer import algorithms as A

pytestmark = pytest.mark.unit

# Constants of our documented choices, restated (not imported) so a silent change shows here.
WHITEN_EPS = 1e-6  # whitening: (x - mean) / (population std + 1e-6)
GRPO_EPS = 1e-6  # GRPO: (x - group mean) / (unbiased group std + 1e-6), verl's epsilon
LOG_RATIO_LIMIT = 20.0
K3_LIMIT = 10.0


# ---- a padded batch -----------------------------------------------------------------------------------
class Batch:
    """B samples padded to T tokens: `mask[b, t]` is 1 on the first lens[b] tokens; `valid[b]` says whether
    the sample is trained on (an invalid one keeps its tokens, the trainer must ignore them)."""

    def __init__(self, seed: int, lens: list[int], invalid: set[int], groups: list[int]) -> None:
        g = torch.Generator().manual_seed(seed)
        self.B, self.T = len(lens), max(lens)
        self.lens = lens
        self.mask = torch.zeros(self.B, self.T)
        for b, n in enumerate(lens):
            self.mask[b, :n] = 1.0
        self.valid = torch.tensor([b not in invalid for b in range(self.B)])
        self.groups = torch.tensor(groups)
        self.scores = torch.randn(self.B, generator=g) * 2.0
        # padding is garbage, as in a real padded batch; the mask must keep it out
        self.logprobs = -torch.rand(self.B, self.T, generator=g) * 3.0
        self.old_logprobs = self.logprobs + torch.randn(self.B, self.T, generator=g) * 0.3
        self.ref_logprobs = self.logprobs + torch.randn(self.B, self.T, generator=g) * 0.5
        self.values = torch.randn(self.B, self.T, generator=g)
        self.old_values = self.values + torch.randn(self.B, self.T, generator=g) * 0.4
        self.returns = torch.randn(self.B, self.T, generator=g)
        self.advantages = torch.randn(self.B, self.T, generator=g)
        self.token_loss = torch.randn(self.B, self.T, generator=g)

    def packed(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Our layout: one 1-D tensor of response tokens per sample."""
        return [x[b, :n].clone() for b, n in enumerate(self.lens)]

    def padded(self, xs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(self.B, self.T)
        for b, x in enumerate(xs):
            out[b, : x.numel()] = x
        return out

    @property
    def train_mask(self) -> torch.Tensor:
        return self.mask * self.valid.float().unsqueeze(1)


BATCHES = [
    Batch(0, lens=[5, 3, 8, 1, 6, 6, 2, 4], invalid={2}, groups=[0, 0, 0, 0, 1, 1, 1, 1]),
    Batch(1, lens=[7, 7, 2, 9, 3, 0], invalid={0, 5}, groups=[0, 0, 0, 1, 1, 1]),  # an empty response
    Batch(2, lens=[4, 6, 1, 3, 5, 2, 8, 7, 2], invalid={1, 4, 7}, groups=[0, 0, 0, 1, 1, 1, 2, 2, 2]),
]


# ---- the reference, from the equations ------------------------------------------------------------------
def ref_kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """With x ~ pi and rho = ref(x) / pi(x): k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho."""
    log_rho = ref_logp.double() - logp.double()
    if kind == "k1":
        return -log_rho
    if kind == "k2":
        return log_rho**2 / 2
    log_rho = log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(log_rho) - 1 - log_rho).clamp(-K3_LIMIT, K3_LIMIT)


def ref_ppo_token_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    """-L^CLIP per token: -min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi / pi_old (log-ratio clamped)."""
    r = torch.exp((logp.double() - old.double()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return -torch.minimum(r * adv, torch.clamp(r, 1 - eps, 1 + eps) * adv)


def ref_value_token_loss(v: torch.Tensor, v_old: torch.Tensor, ret: torch.Tensor, eps: float) -> torch.Tensor:
    """PPO's clipped value loss: 1/2 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)."""
    v_clip = v_old + torch.clamp(v - v_old, -eps, eps)
    return 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)


def ref_aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    """token-mean: sum_bt m l / sum_bt m; seq-mean-token-mean: mean_b (sum_t m l / sum_t m);
    seq-mean-token-sum: mean_b sum_t m l; the means over sequences with at least one masked token."""
    seqs = [b for b in range(loss.shape[0]) if float(mask[b].sum()) > 0]
    if mode == "token-mean":
        return sum(float((loss[b] * mask[b]).sum()) for b in seqs) / sum(float(mask[b].sum()) for b in seqs)
    per_seq = [float((loss[b] * mask[b]).sum()) for b in seqs]
    if mode == "seq-mean-token-mean":
        per_seq = [s / float(mask[b].sum()) for s, b in zip(per_seq, seqs, strict=True)]
    return sum(per_seq) / len(per_seq)


def ref_gae(
    rewards: torch.Tensor, values: torch.Tensor, lens: list[int], gamma: float, lam: float
) -> torch.Tensor:
    """A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V after the end = 0;
    the explicit sum (a triangular matrix of discounts), not the backward recursion."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        v = values[b, :n].double()
        v_next = torch.cat([v[1:], torch.zeros(1, dtype=torch.float64)])
        delta = rewards[b, :n].double() + gamma * v_next - v
        t = torch.arange(n)
        powers = (t.unsqueeze(0) - t.unsqueeze(1)).double()  # [t, k] = k - t
        discount = torch.where(powers >= 0, (gamma * lam) ** powers.clamp(min=0), torch.zeros(()))
        out[b, :n] = discount @ delta
    return out


def ref_discounted_returns(rewards: torch.Tensor, lens: list[int], gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k within each response."""
    return ref_gae(rewards, torch.zeros_like(rewards), lens, gamma, 1.0)


def ref_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mu) / (sigma + eps) with mu, sigma the mean and population std over masked entries; 0 elsewhere."""
    n = mask.sum()
    mu = (x * mask).sum() / n
    sigma = torch.sqrt((((x - mu) * mask) ** 2).sum() / n)
    return (x - mu) / (sigma + WHITEN_EPS) * mask


def ref_group_baseline(batch: Batch, scale: bool) -> torch.Tensor:
    """Per sample: score - mean of its group's valid scores, divided by their unbiased std + eps when
    `scale` (GRPO); 0 for invalid samples and for groups with a single valid sample (no baseline)."""
    out = torch.zeros(batch.B, dtype=torch.float64)
    for g in set(batch.groups.tolist()):
        members = [b for b in range(batch.B) if int(batch.groups[b]) == g and bool(batch.valid[b])]
        if len(members) < 2:
            continue
        s = [float(batch.scores[b]) for b in members]
        mean = sum(s) / len(s)
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1))
        for b, x in zip(members, s, strict=True):
            out[b] = (x - mean) / (std + GRPO_EPS) if scale else x - mean
    return out


def close(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-5) -> bool:
    return bool(torch.allclose(ours.double(), ref.double(), atol=atol, rtol=1e-5))


# ---- the comparisons ------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators(batch: Batch, kind: str) -> None:
    ours = A.kl_per_token(batch.logprobs, batch.ref_logprobs, kind)
    assert close(ours * batch.mask, ref_kl(batch.logprobs, batch.ref_logprobs, kind) * batch.mask)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_kl_estimators_average_to_the_exact_kl(kind: str) -> None:
    """E_{x~pi}[k1] = E_{x~pi}[k3] = KL(pi || ref) = sum_x pi(x) log(pi(x) / ref(x)), exactly, over a vocabulary
    (logits spread so that no k3 term reaches the clamp, which would bias it)."""
    g = torch.Generator().manual_seed(11)
    logp = torch.log_softmax(torch.randn(64, generator=g, dtype=torch.float64) * 0.5, 0)
    ref_logp = torch.log_softmax(torch.randn(64, generator=g, dtype=torch.float64) * 0.5, 0)
    assert float(ref_kl(logp, ref_logp, "k3").max()) < K3_LIMIT / 2
    exact = float((logp.exp() * (logp - ref_logp)).sum())
    estimate = float((logp.exp() * A.kl_per_token(logp, ref_logp, kind)).sum())
    assert estimate == pytest.approx(exact, rel=1e-9)


def test_kl_clamps_at_the_extremes() -> None:
    logp = torch.tensor([-30.0, -8.0, -1.0, 0.0])
    ref_logp = torch.tensor([0.0, -1.0, -8.0, -30.0])
    assert close(A.kl_per_token(logp, ref_logp, "k3"), ref_kl(logp, ref_logp, "k3"))
    assert float(A.kl_per_token(logp, ref_logp, "k3").max()) == K3_LIMIT


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize("clip", [0.1, 0.2])
def test_policy_loss(batch: Batch, clip: float) -> None:
    logp = batch.logprobs.clone()
    logp[0, 0] = batch.old_logprobs[0, 0] + 40.0  # a diverged token: the log-ratio clamp must act
    tokens, clipped = A.policy_loss_tokens(logp, batch.old_logprobs, batch.advantages, clip)
    ref = ref_ppo_token_loss(logp, batch.old_logprobs, batch.advantages, clip)
    m = batch.train_mask
    assert close(tokens * m, ref * m)
    total, n_clipped = A.policy_loss(logp, batch.old_logprobs, batch.advantages, m, clip)
    assert float(total) == pytest.approx(float((ref * m).sum()), rel=1e-5)
    ratio = torch.exp((logp.double() - batch.old_logprobs.double()).clamp(-20, 20))
    outside = ((ratio - 1).abs() > clip).double()
    assert close(clipped * m, outside * m)
    assert float(n_clipped) == float((outside * m).sum())


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_value_loss(batch: Batch) -> None:
    m = batch.train_mask
    ref = ref_value_token_loss(batch.values, batch.old_values, batch.returns, 0.2)
    assert close(A.value_loss_tokens(batch.values, batch.old_values, batch.returns, 0.2) * m, ref * m)
    total = A.value_loss(batch.values, batch.old_values, batch.returns, m, 0.2)
    assert float(total) == pytest.approx(float((ref * m).sum()), rel=1e-5)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_aggregation(batch: Batch, mode: str) -> None:
    m = batch.train_mask
    ours = A.aggregate_loss(batch.token_loss, m, mode)
    assert float(ours) == pytest.approx(ref_aggregate(batch.token_loss, m, mode), rel=1e-5)
    # the same number when the batch is spread over "ranks" with a global normaliser
    cuts = [slice(0, 1), slice(1, batch.B // 2), slice(batch.B // 2, batch.B)]
    total = sum(A.loss_normaliser(m[c], mode) for c in cuts)
    spread = sum(float(A.aggregate_loss(batch.token_loss[c], m[c], mode, total)) for c in cuts)
    assert spread == pytest.approx(ref_aggregate(batch.token_loss, m, mode), rel=1e-5)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_with_kl_rewards_and_whitening(batch: Batch, gamma: float, lam: float) -> None:
    kl_coef = 0.05
    kl = ref_kl(batch.old_logprobs, batch.ref_logprobs, "k1") * batch.mask
    # r_t = -beta KL_t, plus the sequence score on the last response token
    rewards = -kl_coef * kl
    for b, n in enumerate(batch.lens):
        if n:
            rewards[b, n - 1] += float(batch.scores[b])
    ref_adv = ref_gae(rewards, batch.values * batch.mask, batch.lens, gamma, lam)

    ours_kl = batch.packed(A.kl_per_token(batch.old_logprobs, batch.ref_logprobs, "k1"))
    ours_rewards = [A.token_rewards(float(batch.scores[b]), ours_kl[b], kl_coef) for b in range(batch.B)]
    out = A.gae(ours_rewards, batch.packed(batch.values), gamma, lam)
    assert close(batch.padded(out.advantages), ref_adv)
    assert close(batch.padded(out.returns), (ref_adv + batch.values * batch.mask) * batch.mask)
    whitened = A.whiten(out.advantages, batch.valid)
    assert close(batch.padded(whitened), ref_whiten(ref_adv, batch.train_mask), atol=1e-4)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_grpo_advantages(batch: Batch) -> None:
    out = A.grpo(batch.scores, batch.groups, batch.lens, batch.valid)
    ref = ref_group_baseline(batch, scale=True).unsqueeze(1) * batch.mask
    assert close(batch.padded(out.advantages), ref)
    assert [a.numel() for a in out.advantages] == batch.lens


def test_grpo_group_with_one_valid_sample_gets_no_signal() -> None:
    batch = Batch(4, lens=[3, 3, 2, 2], invalid={1}, groups=[0, 0, 1, 1])
    out = A.grpo(batch.scores, batch.groups, batch.lens, batch.valid)
    assert torch.equal(out.advantages[0], torch.zeros(3))  # its group-mate is invalid
    assert close(
        batch.padded(out.advantages), ref_group_baseline(batch, scale=True).unsqueeze(1) * batch.mask
    )


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_advantages(batch: Batch, gamma: float) -> None:
    kl_coef = 0.1
    kl = ref_kl(batch.old_logprobs, batch.ref_logprobs, "k1") * batch.mask
    baseline = ref_group_baseline(batch, scale=False)
    rewards = -kl_coef * kl.double()
    for b, n in enumerate(batch.lens):
        if n:
            rewards[b, n - 1] += float(baseline[b])
    ref = ref_whiten(ref_discounted_returns(rewards, batch.lens, gamma), batch.train_mask)

    ours_kl = batch.packed(A.kl_per_token(batch.old_logprobs, batch.ref_logprobs, "k1"))
    out = A.reinforce_pp(batch.scores, batch.groups, ours_kl, kl_coef, gamma, batch.valid)
    assert close(batch.padded(out.advantages), ref, atol=1e-4)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_whitening_over_ranks_matches_the_whole_batch(batch: Batch) -> None:
    x = batch.advantages * 2.5 + 0.7
    ref = ref_whiten(x.double(), batch.train_mask)
    values = batch.packed(x)
    half = batch.B // 2
    shards = [(values[:half], batch.valid[:half]), (values[half:], batch.valid[half:])]
    moments = sum((A.whitening_moments(v, ok) for v, ok in shards), torch.zeros(3, dtype=torch.float64))
    ours = [w for v, ok in shards for w in A.whiten_with(v, moments, ok)]
    assert close(batch.padded(ours), ref, atol=1e-5)
