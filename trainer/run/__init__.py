"""How a PPO run is built and kept, apart from PPO itself (trainer/ppo.py, rollout.py, rewards.py):
setup.py builds it from the flags, lifecycle.py resumes, logs, saves and ends it, checkpoint.py,
distributed.py, parallel.py, timing.py, run_logger.py, plots.py and provenance.py are its parts."""
