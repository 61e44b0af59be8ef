"""A resources server written outside the nemo-gym-ckpt repository, on the installed package only."""

from __future__ import annotations

from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.resources.base import ResourcesServer, ToolArgs, Verdict, VerifyRequest, final_text, tool


class ShoutArgs(ToolArgs):
    text: str


class Echo(ResourcesServer[ServerConfig]):
    """Shouts back; a rollout is rewarded when its last message is in capitals."""

    checkpoint_mode = "stateless"
    checkpoint_verify = "replay"

    @tool
    async def shout(self, args: ShoutArgs) -> str:
        """Say the text back in capitals."""
        return args.text.upper()

    async def verify(self, task: VerifyRequest) -> Verdict:
        text = final_text(task.response) or ""
        return Verdict(reward=float(bool(text) and text == text.upper()))
