"""``python -m nemo_gym_ckpt`` is the ``nemo-gym-ckpt`` command."""

from nemo_gym_ckpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
