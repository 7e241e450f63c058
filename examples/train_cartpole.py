"""Train CartPole-v1 through an openenv-grpc server: PPO in plain numpy, many sessions.

    python examples/train_cartpole.py                       # starts a local server itself
    python examples/train_cartpole.py --target 127.0.0.1:50051 --num-envs 32
    python examples/train_cartpole.py --quick               # <= 15k steps, for the test suite

Every environment step is a gRPC round trip: ``RemoteGymnasiumVectorEnv`` holds
``--num-envs`` sessions of the server's ``gymnasium`` env over one channel and steps them
concurrently (NEXT_STEP autoreset, Gymnasium's default). The learner is PPO with GAE: two
small tanh MLPs (policy and value) with hand-written gradients and Adam, so numpy is the
only dependency besides the library.

Output: one JSON object per line. Each PPO update prints ``{"update", "env_steps",
"wall_s", "episodes", "mean_return_20", "steps_per_s"}`` (the learning curve: mean return
of the last 20 finished episodes against environment steps and wall time); the last
line is ``{"summary": ...}`` with the first step count and time at which the mean of the
last 20 episodes reached ``--threshold``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from openenv_grpc_envs.gymnasium.adapters import RemoteGymnasiumVectorEnv

Array = npt.NDArray[np.float64]


# -- a tiny MLP with hand-written backprop ----------------------------------------------


@dataclass
class MLP:
    """``sizes[0] -> tanh -> ... -> sizes[-1]`` (linear output), trained with Adam."""

    sizes: list[int]
    rng: np.random.Generator
    out_scale: float = 1.0
    lr: float = 1e-3
    params: list[Array] = field(init=False)
    _m: list[Array] = field(init=False)
    _v: list[Array] = field(init=False)
    _t: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.params = []
        layers = list(zip(self.sizes[:-1], self.sizes[1:], strict=True))
        for i, (n_in, n_out) in enumerate(layers):
            # Orthogonal-ish init scaled like PPO implementations: small last layer.
            scale = self.out_scale if i == len(layers) - 1 else np.sqrt(2.0)
            w = self.rng.standard_normal((n_in, n_out))
            q, _ = np.linalg.qr(w if n_in >= n_out else w.T)
            w = (q if n_in >= n_out else q.T) * scale
            self.params += [w, np.zeros(n_out)]
        self._m = [np.zeros_like(p) for p in self.params]
        self._v = [np.zeros_like(p) for p in self.params]

    def forward(self, x: Array) -> tuple[Array, list[Array]]:
        """The output and the activations backward() needs."""
        acts = [x]
        n = len(self.params) // 2
        for i in range(n):
            z = acts[-1] @ self.params[2 * i] + self.params[2 * i + 1]
            acts.append(np.tanh(z) if i < n - 1 else z)
        return acts[-1], acts

    def backward(self, acts: list[Array], grad_out: Array) -> list[Array]:
        """Gradients of the parameters given dLoss/dOutput."""
        grads: list[Array] = [np.empty(0)] * len(self.params)
        g = grad_out
        n = len(self.params) // 2
        for i in reversed(range(n)):
            grads[2 * i] = acts[i].T @ g
            grads[2 * i + 1] = g.sum(axis=0)
            if i > 0:
                g = (g @ self.params[2 * i].T) * (1.0 - acts[i] ** 2)  # through tanh
        return grads

    def adam(self, grads: list[Array], max_norm: float = 0.5) -> None:
        norm = np.sqrt(sum(float((g**2).sum()) for g in grads))
        if norm > max_norm:  # global gradient clipping, as PPO implementations do
            grads = [g * (max_norm / norm) for g in grads]
        self._t += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        for p, g, m, v in zip(self.params, grads, self._m, self._v, strict=True):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            m_hat = m / (1 - b1**self._t)
            v_hat = v / (1 - b2**self._t)
            p -= self.lr * m_hat / (np.sqrt(v_hat) + eps)


def softmax(logits: Array) -> Array:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


# -- PPO ----------------------------------------------------------------------------------


@dataclass
class Config:
    num_envs: int = 16
    rollout_steps: int = 64  # per env per update
    total_steps: int = 100_000
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    epochs: int = 8
    minibatches: int = 4
    ent_coef: float = 0.0
    lr: float = 1e-3
    hidden: int = 64
    seed: int = 0
    threshold: float = 195.0
    stop_at: float | None = None  # stop once the last-20 mean reaches this


def train(target: str, cfg: Config, out: Any = sys.stdout) -> dict[str, Any]:
    """Run PPO against the server at ``target``; returns the summary (also printed)."""
    rng = np.random.default_rng(cfg.seed)
    envs = RemoteGymnasiumVectorEnv(target, cfg.num_envs, "CartPole-v1")
    try:
        return _train(envs, cfg, rng, out)
    finally:
        envs.close()


def _train(
    envs: RemoteGymnasiumVectorEnv, cfg: Config, rng: np.random.Generator, out: Any
) -> dict[str, Any]:
    n_obs = int(np.prod(envs.single_observation_space.shape or (1,)))
    n_act = int(envs.single_action_space.n)  # type: ignore[attr-defined]
    policy = MLP([n_obs, cfg.hidden, cfg.hidden, n_act], rng, out_scale=0.01, lr=cfg.lr)
    value = MLP([n_obs, cfg.hidden, cfg.hidden, 1], rng, out_scale=1.0, lr=cfg.lr)
    N, T = cfg.num_envs, cfg.rollout_steps

    obs, _ = envs.reset(seed=cfg.seed)
    obs = obs.astype(np.float64)
    autoreset = np.zeros(N, dtype=bool)  # NEXT_STEP: this step only resets these envs
    ep_return = np.zeros(N)
    finished: deque[float] = deque(maxlen=20)
    episodes = 0
    env_steps = 0
    start = time.perf_counter()
    reached: dict[str, Any] | None = None
    update = 0
    curve: list[dict[str, Any]] = []

    while env_steps < cfg.total_steps:
        b_obs = np.zeros((T, N, n_obs))
        b_act = np.zeros((T, N), dtype=np.int64)
        b_logp = np.zeros((T, N))
        b_val = np.zeros((T + 1, N))
        b_rew = np.zeros((T, N))
        b_term = np.zeros((T, N))
        b_done = np.zeros((T, N))
        b_valid = np.zeros((T, N), dtype=bool)
        for t in range(T):
            logits, _ = policy.forward(obs)
            probs = softmax(logits)
            actions = (rng.random((N, 1)) > probs.cumsum(axis=1)).sum(axis=1)
            actions = np.minimum(actions, n_act - 1)
            b_obs[t], b_act[t] = obs, actions
            b_logp[t] = np.log(probs[np.arange(N), actions] + 1e-12)
            b_val[t] = value.forward(obs)[0][:, 0]
            b_valid[t] = ~autoreset
            next_obs, rewards, terms, truncs, _ = envs.step(actions)
            env_steps += int((~autoreset).sum())  # a reset step is not an env step
            b_rew[t], b_term[t] = rewards, terms
            b_done[t] = terms | truncs
            ep_return += rewards
            for i in np.flatnonzero(terms | truncs):
                finished.append(float(ep_return[i]))
                episodes += 1
            ep_return[terms | truncs] = 0.0
            autoreset = terms | truncs
            obs = next_obs.astype(np.float64)
        b_val[T] = value.forward(obs)[0][:, 0]

        # GAE. After a NEXT_STEP episode end, the following row is the reset step (masked
        # out); the row that ended the episode sees the final observation as "next", so a
        # truncated episode bootstraps from V(final obs) and a terminated one from 0.
        adv = np.zeros((T, N))
        last = np.zeros(N)
        for t in reversed(range(T)):
            delta = b_rew[t] + cfg.gamma * b_val[t + 1] * (1.0 - b_term[t]) - b_val[t]
            last = delta + cfg.gamma * cfg.gae_lambda * (1.0 - b_done[t]) * last
            last = np.where(b_valid[t], last, 0.0)
            adv[t] = last
        returns = adv + b_val[:T]

        mask = b_valid.reshape(-1)
        f_obs = b_obs.reshape(-1, n_obs)[mask]
        f_act = b_act.reshape(-1)[mask]
        f_logp = b_logp.reshape(-1)[mask]
        f_adv = adv.reshape(-1)[mask]
        f_ret = returns.reshape(-1)[mask]
        size = len(f_act)
        mb = max(1, size // cfg.minibatches)
        for _ in range(cfg.epochs):
            order = rng.permutation(size)
            for s in range(0, size, mb):
                idx = order[s : s + mb]
                _ppo_minibatch(policy, value, cfg, f_obs[idx], f_act[idx], f_logp[idx],
                               f_adv[idx], f_ret[idx])  # fmt: skip
        update += 1
        wall = time.perf_counter() - start
        mean20 = float(np.mean(finished)) if finished else 0.0
        point = {
            "update": update,
            "env_steps": env_steps,
            "wall_s": round(wall, 2),
            "episodes": episodes,
            "mean_return_20": round(mean20, 1),
            "steps_per_s": round(env_steps / wall, 1),
        }
        curve.append(point)
        print(json.dumps(point), file=out, flush=True)
        if reached is None and len(finished) == 20 and mean20 >= cfg.threshold:
            reached = {"env_steps": env_steps, "wall_s": round(wall, 2), "update": update}
        if cfg.stop_at is not None and len(finished) == 20 and mean20 >= cfg.stop_at:
            break

    summary = {
        "summary": {
            "sessions": cfg.num_envs,
            "env_steps": env_steps,
            "wall_s": round(time.perf_counter() - start, 2),
            "episodes": episodes,
            "final_mean_return_20": round(float(np.mean(finished)) if finished else 0.0, 1),
            "best_mean_return_20": max(p["mean_return_20"] for p in curve),
            "threshold": cfg.threshold,
            "threshold_reached_at": reached,
            "seed": cfg.seed,
        }
    }
    print(json.dumps(summary), file=out, flush=True)
    return summary


def _ppo_minibatch(
    policy: MLP,
    value: MLP,
    cfg: Config,
    obs: Array,
    act: npt.NDArray[np.int64],
    old_logp: Array,
    adv: Array,
    ret: Array,
) -> None:
    n = len(act)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    logits, acts = policy.forward(obs)
    probs = softmax(logits)
    logp_all = np.log(probs + 1e-12)
    logp = logp_all[np.arange(n), act]
    ratio = np.exp(logp - old_logp)
    # d(-min(r A, clip(r) A))/d logp: -A r where the unclipped term is the minimum.
    unclipped = ratio * adv <= np.clip(ratio, 1 - cfg.clip, 1 + cfg.clip) * adv
    d_logp = np.where(unclipped, -adv * ratio, 0.0) / n
    onehot = np.zeros_like(probs)
    onehot[np.arange(n), act] = 1.0
    grad_logits = d_logp[:, None] * (onehot - probs)
    if cfg.ent_coef:
        entropy = -(probs * logp_all).sum(axis=1, keepdims=True)
        grad_logits += cfg.ent_coef * probs * (logp_all + entropy) / n  # -c * dH/dlogits
    policy.adam(policy.backward(acts, grad_logits))
    v, v_acts = value.forward(obs)
    value.adam(value.backward(v_acts, (v[:, 0] - ret)[:, None] / n))


# -- command line -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="HOST:PORT of a gymnasium server (default: start one)")
    parser.add_argument("--num-envs", type=int, default=16, help="parallel sessions")
    parser.add_argument("--total-steps", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=195.0)
    parser.add_argument("--stop-at", type=float, default=None, help="stop at this last-20 mean")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run for tests: at most 15k steps, stops once the last-20 mean is 100",
    )
    args = parser.parse_args(argv)
    cfg = Config(
        num_envs=args.num_envs,
        total_steps=args.total_steps,
        seed=args.seed,
        threshold=args.threshold,
        stop_at=args.stop_at,
    )
    if args.quick:
        cfg.total_steps = min(cfg.total_steps, 15_000)
        cfg.stop_at = 100.0 if cfg.stop_at is None else cfg.stop_at
    if args.target:
        train(args.target, cfg)
        return 0
    from openenv_grpc.providers import LocalProcessProvider  # our own server

    server = LocalProcessProvider("gymnasium")
    server.start()
    try:
        train(server.target, cfg)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
