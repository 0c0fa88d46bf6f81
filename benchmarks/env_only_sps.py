"""Steps per second of an environment alone, stepped as the PPO scripts step it: a SyncVectorEnv with same-step
autoreset (4 envs for discrete actions, 1 for Box ones: the scripts' defaults), random actions drawn beforehand.

    python benchmarks/env_only_sps.py CartPole-v1 [STEPS]
No training loop can be faster than this; benchmarks/rl_speed.sh reports each program's share of it.
"""
import sys
import time

import gymnasium as gym
import numpy as np


def main(env_id, steps=40_960):
    probe = gym.make(env_id)
    num_envs = 4 if isinstance(probe.action_space, gym.spaces.Discrete) else 1
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs.action_space.seed(0)
    actions = [envs.action_space.sample() for _ in range(steps // num_envs)]
    envs.reset(seed=0)
    start = time.perf_counter()
    for action in actions:
        envs.step(action)
    print(f"{steps // num_envs * num_envs / (time.perf_counter() - start):.0f}")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
