"""Our objective (rlhf_trainer.algorithms) against an independent implementation of the papers' equations.

The reference side is written here from the equations alone, in the padded (samples x tokens) layout with
masks that OpenRLHF and verl use (ours is packed, per-sample): PPO's clipped surrogate and clipped value
loss (Schulman et al. 2017) with dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
Deep Reinforcement Learning") and DAPO's clip-higher, dynamic sampling and soft overlong punishment (Yu et
al. 2025), GSPO's sequence-level ratio in its token-level form (Zheng et al. 2025), GAE (Schulman et al.
2016) as an explicit discounted sum, GRPO's group normalisation (Shao et al. 2024) and Dr. GRPO's
unscaled one with a constant loss normaliser (Liu et al. 2025, "Understanding R1-Zero-Like Training"),
RLOO's leave-one-out baseline (Ahmadian et al. 2024), REINFORCE++ with and without a group baseline (Hu
2025), truncated and masked importance sampling of the train-inference mismatch at token and sequence
level (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"), the
adaptive KL controller (Ziegler et al. 2019), running reward normalisation (Chan et al.'s moments, checked
against the moments of everything seen), the k1/k2/k3 KL estimators (Schulman, "Approximating KL
divergence"), and nucleus (top-p) sampling's renormalised log-probs by vLLM's rule (a token is dropped when
the mass of the tokens above it reaches top_p). Random tensors, ragged lengths (padding), invalid and
empty samples. Nothing from the reference projects is imported, and no function of ours computes a
reference value.
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


def ref_aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_constant: float = 1.0) -> float:
    """token-mean: sum_bt m l / sum_bt m; seq-mean-token-mean: mean_b (sum_t m l / sum_t m);
    seq-mean-token-sum: mean_b sum_t m l; seq-mean-token-sum-norm (Dr. GRPO): mean_b (sum_t m l / C) with a
    constant C (the maximum response length); the means over sequences with at least one masked token."""
    seqs = [b for b in range(loss.shape[0]) if float(mask[b].sum()) > 0]
    if mode == "token-mean":
        return sum(float((loss[b] * mask[b]).sum()) for b in seqs) / sum(float(mask[b].sum()) for b in seqs)
    per_seq = [float((loss[b] * mask[b]).sum()) for b in seqs]
    if mode == "seq-mean-token-mean":
        per_seq = [s / float(mask[b].sum()) for s, b in zip(per_seq, seqs, strict=True)]
    if mode == "seq-mean-token-sum-norm":
        per_seq = [s / norm_constant for s in per_seq]
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
    # clipped: where the clip binds (A > 0 above 1 + clip, A < 0 below 1 - clip), not merely |r - 1| > clip
    binds = ref_ppo(logp, batch.old_logprobs, batch.advantages, clip, clip, None).clipped
    assert torch.equal(clipped.double() * m, binds * m)
    assert float(n_clipped) == float((binds * m).sum())


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_value_loss(batch: Batch) -> None:
    m = batch.train_mask
    ref = ref_value_token_loss(batch.values, batch.old_values, batch.returns, 0.2)
    assert close(A.value_loss_tokens(batch.values, batch.old_values, batch.returns, 0.2) * m, ref * m)
    total = A.value_loss(batch.values, batch.old_values, batch.returns, m, 0.2)
    assert float(total) == pytest.approx(float((ref * m).sum()), rel=1e-5)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_loss_aggregation(batch: Batch, mode: str) -> None:
    m = batch.train_mask.double()
    loss = batch.token_loss.double()
    c = 16.0  # Dr. GRPO's constant: the configured maximum response length, not this batch's longest
    ref = ref_aggregate(loss, m, mode, c)
    ours = A.aggregate_loss(loss, m, mode, norm_constant=c)
    assert float(ours) == pytest.approx(ref, rel=1e-9, abs=1e-6)
    # the same number when the batch is spread over "ranks" with a global normaliser
    cuts = [slice(0, 1), slice(1, batch.B // 2), slice(batch.B // 2, batch.B)]
    total = sum(A.loss_normaliser(m[k], mode) for k in cuts)
    spread = sum(float(A.aggregate_loss(loss[k], m[k], mode, total, norm_constant=c)) for k in cuts)
    assert spread == pytest.approx(ref, rel=1e-9, abs=1e-6)
    # the normaliser from per-sample counts: the valid samples' tokens, or the valid samples with a response
    seqs = [b for b in range(batch.B) if bool(batch.valid[b]) and batch.lens[b] > 0]
    expected = sum(batch.lens[b] for b in seqs) if mode == "token-mean" else len(seqs)
    assert A.sample_normaliser(torch.tensor(batch.lens), batch.valid, mode) == expected == total


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
@pytest.mark.parametrize("baseline", [False, True], ids=["reinforce++", "reinforce++_baseline"])
def test_reinforce_pp_advantages(batch: Batch, gamma: float, baseline: bool) -> None:
    """r_t = -beta KL_t, plus on the last token the score (REINFORCE++) or the score minus its group's mean
    (OpenRLHF's reinforce++_baseline); G_t the returns-to-go, whitened over all valid tokens."""
    kl_coef = 0.1
    kl = ref_kl(batch.old_logprobs, batch.ref_logprobs, "k1") * batch.mask
    final = ref_group_baseline(batch, scale=False) if baseline else batch.scores.double()
    rewards = -kl_coef * kl.double()
    for b, n in enumerate(batch.lens):
        if n:
            rewards[b, n - 1] += float(final[b])
    returns = ref_discounted_returns(rewards, batch.lens, gamma)
    ref = ref_whiten(returns, batch.train_mask)

    ours_kl = batch.packed(A.kl_per_token(batch.old_logprobs, batch.ref_logprobs, "k1"))
    rets = A.reinforce_pp_returns(batch.scores, batch.groups, ours_kl, kl_coef, gamma, batch.valid, baseline)
    assert close(batch.padded(rets) * batch.train_mask, returns * batch.train_mask, atol=1e-6)
    out = A.reinforce_pp(batch.scores, batch.groups, ours_kl, kl_coef, gamma, batch.valid, baseline)
    assert close(batch.padded(out.advantages), ref, atol=1e-6)


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


# ---- PPO with clip-higher (DAPO) and dual clip (Ye et al. 2020) -----------------------------------------
TOL = 1e-6  # the new comparisons: float64 on both sides, within 1e-6


def close6(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within TOL absolutely (and 1e-9 relatively, for the e^20 of a clamped log-ratio)."""
    return bool(torch.allclose(ours.double(), ref.double(), atol=TOL, rtol=1e-9))


class Surrogate:
    """A reference per-token loss, the 0/1 indicators of its clips, and d loss / d log pi per token."""

    def __init__(
        self, loss: torch.Tensor, clipped: torch.Tensor, dual: torch.Tensor, grad: torch.Tensor
    ) -> None:
        self.loss, self.clipped, self.dual_clipped, self.grad = loss, clipped, dual, grad


def ref_ppo(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    low: float,
    high: float | None,
    dual: float | None,
) -> Surrogate:
    """-min(r A, clip(r, 1 - low, 1 + high) A) per token, r = pi / pi_old (log-ratio clamped to +-20), written
    by the sign of A: A > 0: -A min(r, 1 + high); A < 0: |A| max(r, 1 - low), and with dual clip c (Ye et al.,
    max(min(r A, clip(r) A), c A) for A < 0) |A| min(max(r, 1 - low), c). The clip binds where A > 0 and
    r > 1 + high, or A < 0 and r < 1 - low (there the loss is flat in r); the dual clip where A < 0 and r > c.
    Elsewhere d loss / d log pi = -A r (and 0 where the log-ratio is beyond its clamp)."""
    high = low if high is None else high
    a = adv.double()
    lr = logp.double() - old.double()
    r = torch.exp(lr.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    pos = -a * torch.minimum(r, torch.full_like(r, 1 + high))
    neg = -a * torch.maximum(r, torch.full_like(r, 1 - low))
    clipped = ((a > 0) & (r > 1 + high)) | ((a < 0) & (r < 1 - low))
    dual_clipped = torch.zeros_like(clipped)
    if dual is not None:
        neg = -a * torch.minimum(torch.maximum(r, torch.full_like(r, 1 - low)), torch.full_like(r, dual))
        dual_clipped = (a < 0) & (r > dual)
    loss = torch.where(a > 0, pos, torch.where(a < 0, neg, torch.zeros_like(r)))
    inside = lr.abs() <= LOG_RATIO_LIMIT
    grad = torch.where(~clipped & ~dual_clipped & inside, -a * r, torch.zeros_like(r))
    return Surrogate(loss, clipped.double(), dual_clipped.double(), grad)


def first_long_valid_row(batch: Batch, n: int) -> int:
    return next(b for b in range(batch.B) if bool(batch.valid[b]) and batch.lens[b] >= n)


# (log-ratio, advantage) placed on a valid row: where clip-higher, the low bound, a clip that does not bind
# (r > 1 + eps with A < 0), the dual clip and the log-ratio clamp each decide the token's loss
PPO_PROBES = [
    (math.log(1.25), 1.0),
    (math.log(0.75), -1.0),
    (math.log(1.5), -0.7),
    (math.log(4.0), -0.5),
    (40.0, -0.3),
]


def ppo_inputs(batch: Batch, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log-probs, old log-probs with log-ratios ~ N(0, 0.6^2) (ratios from about 0.2 to 5), and
    advantages, with PPO_PROBES on the first valid row long enough."""
    g = torch.Generator().manual_seed(seed)
    logp = batch.logprobs.double()
    old = logp - torch.randn(batch.B, batch.T, generator=g, dtype=torch.float64) * 0.6
    adv = batch.advantages.double().clone()
    row = first_long_valid_row(batch, len(PPO_PROBES))
    for t, (log_ratio, a) in enumerate(PPO_PROBES):
        old[row, t] = logp[row, t] - log_ratio
        adv[row, t] = a
    return logp, old, adv


PPO_CLIPS = [(0.2, None, None), (0.2, 0.28, None), (0.2, 0.28, 3.0), (0.2, 0.2, 2.0), (0.1, 0.3, 1.8)]


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize(("low", "high", "dual"), PPO_CLIPS)
def test_ppo_tokens(batch: Batch, low: float, high: float | None, dual: float | None) -> None:
    """Loss, clip indicators and the gradient wrt the log-probs, on the valid tokens."""
    logp, old, adv = ppo_inputs(batch, seed=7)
    ref = ref_ppo(logp, old, adv, low, high, dual)
    m = batch.train_mask.double()
    lp = logp.clone().requires_grad_(True)
    out = A.ppo_tokens(lp, old, adv, low, high, dual)
    assert close6(out.loss.detach() * m, ref.loss * m)
    assert torch.equal(out.clipped.double() * m, ref.clipped * m)
    assert torch.equal(out.dual_clipped.double() * m, ref.dual_clipped * m)
    w = torch.rand(batch.B, batch.T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out.loss * m * w).sum(), lp)
    assert close6(grad, ref.grad * m * w)
    # the inputs exercise every branch: a binding clip, one that does not, and (with c) the dual clip
    assert float((ref.clipped * m).sum()) > 0 and float(((1 - ref.clipped) * m).sum()) > 0
    if dual is not None:
        assert float((ref.dual_clipped * m).sum()) > 0


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_clip_higher_bounds_are_asymmetric(batch: Batch) -> None:
    """clip_low bounds r below and clip_high above: with (0.2, 0.28) a token at r = 1.25, A > 0 is not clipped
    (it would be with 0.2 on both sides), one at r = 0.75, A < 0 is (it would not be with 0.28 on both)."""
    logp, old, adv = ppo_inputs(batch, seed=8)
    m = batch.train_mask.double()
    out = A.ppo_tokens(logp, old, adv, 0.2, 0.28)
    ref = ref_ppo(logp, old, adv, 0.2, 0.28, None)
    assert close6(out.loss * m, ref.loss * m)
    for low, high in [(0.2, 0.2), (0.28, 0.28), (0.28, 0.2)]:
        assert not close6(ref_ppo(logp, old, adv, low, high, None).loss * m, ref.loss * m)
    row = first_long_valid_row(batch, len(PPO_PROBES))
    assert float(out.loss[row, 0]) == pytest.approx(-1.25, abs=TOL) and float(out.clipped[row, 0]) == 0.0
    assert float(out.loss[row, 1]) == pytest.approx(0.8, abs=TOL) and float(out.clipped[row, 1]) == 1.0
    assert torch.equal(A.ppo_tokens(logp, old, adv, 0.2).loss, A.ppo_tokens(logp, old, adv, 0.2, 0.2).loss)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize("dual", [1.5, 3.0])
def test_dual_clip_caps_the_loss_of_negative_advantages(batch: Batch, dual: float) -> None:
    """With A < 0 the loss never exceeds c |A| (it is c |A| where r > c, the unclipped loss there being
    larger); with A >= 0 the dual clip changes nothing."""
    logp, old, adv = ppo_inputs(batch, seed=9)
    m = batch.train_mask.double() > 0
    plain = A.ppo_tokens(logp, old, adv, 0.2, 0.28)
    capped = A.ppo_tokens(logp, old, adv, 0.2, 0.28, dual)
    neg, pos = m & (adv < 0), m & (adv >= 0)
    assert bool((capped.loss[neg] <= -dual * adv[neg] + TOL).all())
    r = torch.exp((logp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    over = neg & (r > dual)
    assert bool(over.any())
    assert bool((plain.loss[over] > -dual * adv[over]).all())
    assert close6(capped.loss[over], -dual * adv[over])
    assert torch.equal(capped.dual_clipped[m], over[m].double())
    assert torch.equal(capped.loss[pos], plain.loss[pos])
    assert float(plain.dual_clipped.abs().sum()) == 0.0


def test_clip_fraction_counts_only_binding_clips() -> None:
    """clipped = 1 only where the clipped term is the one taken: r above 1 + eps with A < 0 (or below 1 - eps
    with A > 0) is outside the range but the unclipped term is the larger loss, so it counts 0."""
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1, 0.9, 1.25, 0.75], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    old = torch.zeros(8, dtype=torch.float64)
    expected = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    out = A.ppo_tokens(ratio.log(), old, adv, 0.2)
    assert (
        out.clipped.tolist() == expected == ref_ppo(ratio.log(), old, adv, 0.2, None, None).clipped.tolist()
    )
    _, clipped = A.policy_loss_tokens(ratio.log(), old, adv, 0.2)
    assert clipped.tolist() == expected
    assert A.ppo_tokens(ratio.log(), old, adv, 0.2, 0.3).clipped.tolist() == [1.0, 0, 0, 1.0, 0, 0, 0, 1.0]


# ---- GSPO (Zheng et al. 2025), token-level form ---------------------------------------------------------
def ref_gspo(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, lens: list[int], low: float, high: float | None
) -> Surrogate:
    """s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean over the response of the token log-ratios); the
    GSPO-token objective min(s_it A_it, clip(s_it, 1 - low, 1 + high) A_it) with s_it = sg[s_i] pi_t / sg[pi_t]:
    value s_i on every token, d s_it / d log pi_t = s_i (no gradient to the row's other tokens). The loss is
    the PPO surrogate's with the ratio s_i; d loss_t / d log pi_t = -A_t s_i where the clip does not bind."""
    s = torch.ones_like(logp, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n:
            s[b, :] = math.exp(sum(float(logp[b, t]) - float(old[b, t]) for t in range(n)) / n)
    ppo = ref_ppo(s.log(), torch.zeros_like(s), adv, low, high, None)
    return Surrogate(ppo.loss, ppo.clipped, torch.zeros_like(s), ppo.grad)


GSPO_CLIPS = [(0.1, None), (0.1, 0.15), (3e-4, 4e-4)]  # the last: the paper's range


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize(("low", "high"), GSPO_CLIPS)
def test_gspo_tokens(batch: Batch, low: float, high: float | None) -> None:
    """Loss (one ratio per sequence, padding ignored), clip indicators, and the gradient wrt each token's
    log-prob: -A_t s_i on unclipped tokens, 0 on clipped ones and on padding."""
    g = torch.Generator().manual_seed(12)
    logp = batch.logprobs.double()
    old = logp - torch.randn(batch.B, batch.T, generator=g, dtype=torch.float64) * 0.3
    adv = batch.advantages.double()
    ref = ref_gspo(logp, old, adv, batch.lens, low, high)
    mask = batch.mask.double()
    m = batch.train_mask.double()
    lp = logp.clone().requires_grad_(True)
    out = A.gspo_tokens(lp, old, adv, mask, low, high)
    assert close6(out.loss.detach() * m, ref.loss * m)
    assert torch.equal(out.clipped.double() * m, ref.clipped * m)
    assert float(out.dual_clipped.abs().sum()) == 0.0
    w = torch.rand(batch.B, batch.T, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((out.loss * m * w).sum(), lp)
    assert close6(grad, ref.grad * m * w)
    assert float((ref.clipped * m).sum()) > 0 and float(((1 - ref.clipped) * m).sum()) > 0
    # a token-level ratio would be a different loss: the sequence ratio is what is being checked
    assert not close6(ref_ppo(logp, old, adv, low, high, None).loss * m, ref.loss * m)


# ---- rollout importance weights: truncated / masked IS (Yao et al. 2025) ---------------------------------
def ref_rollout_weights(
    prox: torch.Tensor,
    behav: torch.Tensor,
    lens: list[int],
    level: str,
    mode: str,
    lower: float,
    upper: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = pi_prox(y_t) / pi_behav(y_t) per token, or per sequence the product of its tokens' ratios (in
    [e^-20, e^20], the log-ratio clamp), on every token of the row. truncate: min(max(w, lower), upper), all
    kept; mask: kept where lower <= w <= upper, weight w there and 0 elsewhere."""
    ratio = torch.exp(prox.double() - behav.double())
    w = torch.ones_like(ratio)
    for b, n in enumerate(lens):
        for t in range(n):
            if level == "token":
                w[b, t] = min(max(float(ratio[b, t]), math.exp(-LOG_RATIO_LIMIT)), math.exp(LOG_RATIO_LIMIT))
            else:
                prod = math.prod(float(ratio[b, k]) for k in range(n))
                w[b, t] = min(max(prod, math.exp(-LOG_RATIO_LIMIT)), math.exp(LOG_RATIO_LIMIT))
    if mode == "truncate":
        return w.clamp(lower, upper), torch.ones_like(w)
    kept = ((w >= lower) & (w <= upper)).double()
    return w * kept, kept


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
@pytest.mark.parametrize(
    ("level", "mode", "lower", "upper"),
    [
        ("token", "truncate", 0.0, 2.0),
        ("token", "mask", 0.5, 2.0),
        ("sequence", "truncate", 0.0, 3.0),
        ("sequence", "truncate", 0.5, 3.0),
        ("sequence", "mask", 0.2, 5.0),
    ],
)
def test_rollout_weights(batch: Batch, level: str, mode: str, lower: float, upper: float) -> None:
    g = torch.Generator().manual_seed(21)
    prox = batch.old_logprobs.double().requires_grad_(True)
    behav = prox.detach() + torch.randn(batch.B, batch.T, generator=g, dtype=torch.float64) * 0.7
    behav[0, 0] = prox[0, 0].detach() - 30.0  # beyond the log-ratio clamp
    last = max(b for b in range(batch.B) if batch.lens[b] > 0)
    behav[last, 0] = prox[last, 0].detach() + 5.0  # a token the engine found far likelier
    weight, kept = A.rollout_weights(prox, behav, batch.mask.double(), level, mode, lower, upper)
    ref_w, ref_kept = ref_rollout_weights(prox.detach(), behav, batch.lens, level, mode, lower, upper)
    m = batch.mask.double()
    assert close6(weight * m, ref_w * m)
    assert torch.equal(kept.double() * m, ref_kept * m)
    assert not weight.requires_grad  # detached: a weight scales the loss, it is not trained through
    # the bounds act on these inputs (some weights are outside [lower, upper])
    raw, _ = ref_rollout_weights(prox.detach(), behav, batch.lens, level, "truncate", 0.0, math.inf)
    assert bool(((raw > upper) & (m > 0)).any())
    if lower > 0:
        assert bool(((raw < lower) & (m > 0)).any())


def test_rollout_weights_reject_an_unknown_level_or_mode() -> None:
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="tokenwise"):
        A.rollout_weights(x, x, m, "tokenwise", "mask", 0.0, 2.0)
    with pytest.raises(ValueError, match="drop"):
        A.rollout_weights(x, x, m, "token", "drop", 0.0, 2.0)


# ---- nucleus (top-p) log-probs, by vLLM's rule ------------------------------------------------------------
def ref_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The kept set per position (bool, last dim the vocabulary): tokens by descending probability, a token is
    kept while the mass of the tokens strictly above it is below top_p (the smallest prefix whose mass reaches
    top_p). This is vLLM's rule: sorted ascending, a token is dropped where the cumulative mass up to and
    including it is <= 1 - top_p, i.e. where the mass above it is >= top_p; the top token is always kept."""
    probs = torch.softmax(logits.double(), dim=-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    flat_p, flat_keep = probs.reshape(-1, probs.shape[-1]), keep.view(-1, probs.shape[-1])
    for row in range(flat_p.shape[0]):
        above = 0.0
        for v in sorted(range(flat_p.shape[1]), key=lambda k: -float(flat_p[row, k])):
            if above < top_p or above == 0.0:
                flat_keep[row, v] = True
            above += float(flat_p[row, v])
    return keep


def ref_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z = logits / T; over the kept set K: log p(v) = z_v - log sum_{u in K} e^z_u; entropy -sum_K p log p.
    Returns (log-probs of labels, entropy, log-probs over the vocabulary with -inf outside K)."""
    z = logits.double() / temperature
    keep = ref_nucleus(z, top_p) if top_p < 1.0 else torch.ones_like(z, dtype=torch.bool)
    log_z = torch.logsumexp(torch.where(keep, z, torch.full_like(z, -math.inf)), dim=-1, keepdim=True)
    logp = torch.where(keep, z - log_z, torch.full_like(z, -math.inf))
    p = torch.where(keep, logp.exp(), torch.zeros_like(z))
    entropy = -(p * torch.where(keep, logp, torch.zeros_like(z))).sum(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy, logp


def nucleus_logits(seed: int) -> torch.Tensor:
    """(samples x tokens x vocabulary) logits, spread enough that a nucleus is a real subset."""
    return torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2.5


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.95])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3])
def test_top_p_logits_keep_the_nucleus(top_p: float, temperature: float) -> None:
    z = nucleus_logits(31) / temperature
    keep = ref_nucleus(z, top_p)
    ours = A.top_p_logits(z, top_p)
    assert torch.equal(torch.isfinite(ours), keep)
    assert torch.equal(ours[keep], z[keep])
    assert bool((ours[~keep] == -math.inf).all())
    kept = keep.sum(-1)
    assert int(kept.max()) < z.shape[-1] and int(kept.max()) > 1  # a real subset, more than the top token


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.95, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.3])
def test_token_logprobs_are_renormalised_over_the_nucleus(top_p: float, temperature: float) -> None:
    """Log-probs of labels sampled from the nucleus, the entropy of the renormalised distribution, and over
    the whole nucleus: sum_K p = 1 (logsumexp of the kept log-probs is 0)."""
    logits = nucleus_logits(32)
    g = torch.Generator().manual_seed(33)
    _, _, ref_all = ref_token_logprobs(logits, torch.zeros(3, 5, dtype=torch.long), temperature, top_p)
    probs = ref_all.exp().reshape(-1, logits.shape[-1])
    labels = torch.multinomial(probs, 1, generator=g).reshape(3, 5)
    ref_lp, ref_ent, _ = ref_token_logprobs(logits, labels, temperature, top_p)
    lp, ent = A.token_logprobs(logits, labels, temperature, top_p)
    assert close6(lp, ref_lp)
    assert close6(ent, ref_ent)
    # every kept token as the label: its log-prob, and the kept set's total mass
    keep = torch.isfinite(ref_all)
    vocab = logits.shape[-1]
    every = torch.arange(vocab).expand(3, 5, vocab)
    lp_all, _ = A.token_logprobs(logits.unsqueeze(-2).expand(3, 5, vocab, vocab), every, temperature, top_p)
    assert close6(lp_all[keep], ref_all[keep])
    masked = torch.where(keep, lp_all, torch.full_like(lp_all, -math.inf))
    assert close6(torch.logsumexp(masked, dim=-1), torch.zeros(3, 5))


@pytest.mark.parametrize(("top_p", "temperature"), [(0.9, 1.0), (0.7, 0.6), (1.0, 1.3)])
def test_token_logprobs_gradients(top_p: float, temperature: float) -> None:
    """With p the renormalised nucleus distribution of z = logits / T over K, for v in K:
    d log p(y) / d logit_v = (1[v = y] - p_v) / T and d H / d logit_v = -p_v (log p_v + H) / T; both 0 for
    v outside K (a dropped token gets no gradient). The entropy trains only when asked (entropy_grad)."""
    logits = nucleus_logits(37).requires_grad_(True)
    _, _, ref_all = ref_token_logprobs(
        logits.detach(), torch.zeros(3, 5, dtype=torch.long), temperature, top_p
    )
    keep = torch.isfinite(ref_all)
    p = torch.where(keep, ref_all.exp(), torch.zeros_like(ref_all))
    labels = torch.multinomial(p.reshape(-1, 40), 1, generator=torch.Generator().manual_seed(38)).reshape(
        3, 5
    )
    w = torch.rand(3, 5, generator=torch.Generator().manual_seed(39), dtype=torch.float64)
    lp, ent = A.token_logprobs(logits, labels, temperature, top_p, entropy_grad=True)
    (g_lp,) = torch.autograd.grad((lp * w).sum(), logits, retain_graph=True)
    (g_ent,) = torch.autograd.grad((ent * w).sum(), logits)
    one_hot = torch.nn.functional.one_hot(labels, 40).double()
    ref_g_lp = (one_hot - p) / temperature * w.unsqueeze(-1)
    log_p = torch.where(keep, ref_all, torch.zeros_like(ref_all))
    h = -(p * log_p).sum(-1, keepdim=True)
    ref_g_ent = -p * (log_p + h) / temperature * w.unsqueeze(-1)
    assert close6(g_lp, ref_g_lp)
    assert close6(g_ent, ref_g_ent)
    assert bool(torch.isfinite(g_ent).all())
    _, detached = A.token_logprobs(logits, labels, temperature, top_p)
    assert not detached.requires_grad


def test_top_p_of_one_changes_nothing_and_a_tiny_top_p_keeps_the_top_token() -> None:
    logits = nucleus_logits(34)
    assert torch.equal(A.top_p_logits(logits, 1.0), logits)
    labels = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(35))
    lp, ent = A.token_logprobs(logits, labels, 0.8, 1.0)
    z = logits / 0.8
    assert close6(lp, torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1))
    assert close6(ent, -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1))
    tiny = A.top_p_logits(logits, 1e-6)
    assert torch.equal(torch.isfinite(tiny), ref_nucleus(logits, 1e-6))
    assert bool((torch.isfinite(tiny).sum(-1) == 1).all())
    top = logits.argmax(-1)
    lp, ent = A.token_logprobs(logits, top, 1.0, 1e-6)
    assert close6(lp, torch.zeros(3, 5)) and close6(ent, torch.zeros(3, 5))


def test_a_label_outside_the_nucleus_is_renormalised_with_it() -> None:
    """Ours, by design (its comment): a sampled label is never dropped (the engine sampled it, so it was in
    the engine's nucleus; only a rounding difference can put it outside ours): the distribution is the
    nucleus plus that label, renormalised. Reference: the same set, from the definition."""
    logits = nucleus_logits(36)
    keep = ref_nucleus(logits, 0.5)
    low = logits.argmin(-1)  # outside every nucleus here
    assert not bool(keep.gather(-1, low.unsqueeze(-1)).any())
    keep_plus = keep.scatter(-1, low.unsqueeze(-1), True)
    log_z = torch.logsumexp(torch.where(keep_plus, logits, torch.full_like(logits, -math.inf)), -1)
    lp, _ = A.token_logprobs(logits, low, 1.0, 0.5)
    assert close6(lp, logits.gather(-1, low.unsqueeze(-1)).squeeze(-1) - log_z)


# ---- estimators: Dr. GRPO, RLOO ---------------------------------------------------------------------------
ESTIMATOR_BATCHES = [*BATCHES, Batch(4, lens=[3, 3, 2, 2, 5], invalid={1}, groups=[0, 0, 1, 1, 1])]


@pytest.mark.parametrize("batch", ESTIMATOR_BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_dr_grpo_advantages(batch: Batch) -> None:
    """Dr. GRPO: A_i = s_i - mean of its group's valid scores, no division by their std."""
    out = A.grpo(batch.scores, batch.groups, batch.lens, batch.valid, scale=False)
    ref = ref_group_baseline(batch, scale=False).unsqueeze(1) * batch.mask
    assert close6(batch.padded(out.advantages), ref)
    assert [a.numel() for a in out.advantages] == batch.lens


def ref_rloo(batch: Batch) -> torch.Tensor:
    """A_i = s_i - 1/(n-1) sum_{j != i} s_j over the valid samples j of i's group (n of them, n >= 2);
    0 for invalid samples and for a group with a single valid sample."""
    out = torch.zeros(batch.B, dtype=torch.float64)
    for i in range(batch.B):
        if not bool(batch.valid[i]):
            continue
        others = [
            float(batch.scores[j])
            for j in range(batch.B)
            if j != i and bool(batch.valid[j]) and int(batch.groups[j]) == int(batch.groups[i])
        ]
        if others:
            out[i] = float(batch.scores[i]) - sum(others) / len(others)
    return out


@pytest.mark.parametrize("batch", ESTIMATOR_BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_rloo_advantages(batch: Batch) -> None:
    out = A.rloo(batch.scores, batch.groups, batch.lens, batch.valid)
    ref = ref_rloo(batch).unsqueeze(1) * batch.mask
    assert close6(batch.padded(out.advantages), ref)
    assert [a.numel() for a in out.advantages] == batch.lens


# ---- the adaptive KL controller (Ziegler et al. 2019) ----------------------------------------------------
def test_adaptive_kl_controller() -> None:
    """e_t = clip(KL_t / KL_target - 1, -0.2, 0.2); beta_{t+1} = beta_t (1 + K_beta e_t n_t / H)."""
    target, horizon, n = 0.1, 10_000, 512
    kls = [0.5, 0.0, 0.11, 0.09, 0.1, 0.3, 0.02, 0.105, 1.0, 0.0]
    ctl = A.AdaptiveKL(coef=0.05, target=target, horizon=horizon)
    beta = 0.05
    for kl in kls:
        e = min(max(kl / target - 1.0, -0.2), 0.2)
        beta = beta * (1.0 + e * n / horizon)
        assert ctl.update(kl, n) == pytest.approx(beta, rel=1e-12)
        assert ctl.coef == pytest.approx(beta, rel=1e-12)


# ---- reward shaping: clipping, DAPO's overlong punishment, running normalisation ------------------------
def test_clip_scores() -> None:
    scores = torch.randn(50, generator=torch.Generator().manual_seed(41), dtype=torch.float64) * 3
    ours = A.clip_scores(scores, 2.0)
    ref = torch.tensor([min(max(float(s), -2.0), 2.0) for s in scores], dtype=torch.float64)
    assert close6(ours, ref)
    assert bool((scores.abs() > 2.0).any())
    assert torch.equal(A.clip_scores(scores, None), scores)


@pytest.mark.parametrize(("max_len", "buffer", "factor"), [(20, 6, 1.0), (32, 8, 0.5), (10, 1, 2.0)])
def test_overlong_penalty(max_len: int, buffer: int, factor: float) -> None:
    """DAPO's R_length(y): 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache (times the
    factor) if L_max - L_cache < |y| <= L_max; -1 (times the factor) if |y| > L_max."""
    lens = list(range(0, max_len + 5))
    expected = []
    for n in lens:
        if n <= max_len - buffer:
            expected.append(0.0)
        elif n <= max_len:
            expected.append(((max_len - buffer) - n) / buffer * factor)
        else:
            expected.append(-factor)
    ours = A.overlong_penalty(torch.tensor(lens), max_len, buffer, factor)
    assert close6(ours, torch.tensor(expected, dtype=torch.float64))


def test_running_moments_match_everything_seen() -> None:
    """After each batch: count, mean and population std of the concatenation of every batch so far (an
    empty batch changes nothing); normalised scores (s - mean) / (std + 1e-6)."""
    g = torch.Generator().manual_seed(42)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1.5 for n in (7, 1, 0, 16, 3)]
    moments = A.RunningMoments()
    assert moments.std == 0.0
    seen: list[float] = []
    for x in batches:
        moments = moments.merged(
            torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()))]).double()
        )
        seen += x.tolist()
        mean = sum(seen) / len(seen)
        std = math.sqrt(sum((v - mean) ** 2 for v in seen) / len(seen))
        assert moments.count == len(seen)
        assert moments.mean == pytest.approx(mean, abs=1e-9)
        assert moments.std == pytest.approx(std, abs=1e-9)
        scores = torch.randn(5, generator=g, dtype=torch.float64)
        ref = torch.tensor([(float(s) - mean) / (std + WHITEN_EPS) for s in scores], dtype=torch.float64)
        assert close6(A.normalise_scores(scores, moments), ref)


# ---- DAPO's dynamic sampling ------------------------------------------------------------------------------
def test_informative_groups() -> None:
    """A group is kept when two of its rewards differ by more than tol (so its group baseline is not the
    reward itself and some advantage is non-zero)."""
    g = torch.Generator().manual_seed(43)
    size = 4
    scores = [float(s) for s in torch.randint(0, 2, (40 * size,), generator=g)]
    scores += [0.5, 0.5 + 1e-12, 0.5, 0.5, 0.0, 0.0, 0.0, 1e-6, -1.0, -1.0, -1.0, -1.0]
    ref = [
        any(abs(a - b) > 1e-9 for a in scores[i : i + size] for b in scores[i : i + size])
        for i in range(0, len(scores), size)
    ]
    assert A.informative_groups(scores, size) == ref
    assert any(ref) and not all(ref)
    assert ref[-3:] == [False, True, False]
    assert A.informative_groups([0.0, 0.1, 0.0, 0.0], size, tol=0.2) == [False]


# ---- the train-inference log-prob mismatch ---------------------------------------------------------------
def ref_quantile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b.B}xT{b.T}")
def test_logprob_mismatch(batch: Batch) -> None:
    trainer = batch.logprobs.double()
    engine = batch.old_logprobs.double()
    m = batch.train_mask
    diffs = [
        float(trainer[b, t] - engine[b, t]) for b in range(batch.B) for t in range(batch.T) if m[b, t] > 0
    ]
    ours = A.logprob_mismatch(trainer, engine, m)
    assert ours["mean"] == pytest.approx(sum(diffs) / len(diffs), abs=TOL)
    assert ours["p99"] == pytest.approx(ref_quantile([abs(d) for d in diffs], 0.99), abs=TOL)
    assert ours["max"] == pytest.approx(max(abs(d) for d in diffs), abs=TOL)
    assert A.logprob_mismatch(trainer, engine, torch.zeros_like(m)) == {"mean": 0.0, "p99": 0.0, "max": 0.0}
