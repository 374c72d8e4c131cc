"""Safety monitors on synthetic metric streams: each fires exactly when its condition holds."""
from jalign.rl.monitors import Monitors


def test_entropy_collapse_fires_below_the_floor_and_warns_once():
  m = Monitors(entropy_floor=0.05)
  assert m.after_step(1, {"actor/entropy": 0.3}) == ({}, [])
  signals, warnings = m.after_step(2, {"actor/entropy": 0.01})
  assert signals == {"monitor/entropy_collapse": 1.0} and "entropy collapse" in warnings[0]
  signals, warnings = m.after_step(3, {"actor/entropy": 0.02})
  assert signals == {"monitor/entropy_collapse": 1.0} and warnings == []
  assert Monitors(entropy_floor=0.0).after_step(1, {"actor/entropy": 0.0}) == ({}, [])


def test_reward_hacking_is_reward_up_while_held_out_accuracy_down():
  m = Monitors(entropy_floor=0.0)
  m.after_eval(0, 0.60, 500)
  for step, r in enumerate([0.5, 0.6], 1):
    m.after_step(step, {"critic/score/mean": r})
  assert m.after_eval(2, 0.65, 500) == ({}, [])         # first window: nothing to compare the reward with
  for step, r in enumerate([0.8, 0.9], 3):
    m.after_step(step, {"critic/score/mean": r})
  signals, warnings = m.after_eval(4, 0.55, 500)   # reward 0.55 -> 0.85, accuracy 0.65 -> 0.55
  assert signals == {"monitor/reward_hacking": 1.0} and "possible reward hacking" in warnings[0]
  for step, r in enumerate([0.95, 0.97], 5):
    m.after_step(step, {"critic/score/mean": r})
  assert m.after_eval(6, 0.70, 500) == ({}, [])    # both up: learning the task
  for step, r in enumerate([0.98, 0.99], 7):
    m.after_step(step, {"critic/score/mean": r})
  assert m.after_eval(8, 0.69, 500) == ({}, [])    # a drop within two standard errors (0.041) is noise


def test_critic_failure_needs_a_whole_window_of_non_positive_explained_variance():
  m = Monitors(entropy_floor=0.0, window=3)
  for step, ev in enumerate([-0.5, -0.2], 1):
    assert m.after_step(step, {"critic/vf_explained_var": ev}) == ({}, [])
  signals, warnings = m.after_step(3, {"critic/vf_explained_var": -0.1})
  assert signals == {"monitor/critic_failure": 1.0} and "explained variance" in warnings[0]
  for step, ev in enumerate([-0.5, 0.1, -0.2], 4):
    assert m.after_step(step, {"critic/vf_explained_var": ev}) == ({}, [])
