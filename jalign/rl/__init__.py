"""Experience for RL: reward functions, rollouts into a replay buffer."""
