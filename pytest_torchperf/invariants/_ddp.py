"""What the DDP invariants share: which launcher and strategy trained, for their hints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..frameworks._calls import FrameworkCall

__all__ = ["Context"]


class Context:
    """The training framework a run saw: a Lightning Trainer (and its strategy), or plain PyTorch."""

    def __init__(self) -> None:
        self.lightning = False
        self.spawn = False  # Lightning's strategy starts its ranks with torch.multiprocessing (ddp_spawn)
        self.manual_optimization = False
        self.strategy: Optional[str] = None
        #: The framework whose call trained (an adapter's NAME), if any.
        self.framework: Optional[str] = None

    def on_framework_call(self, call: FrameworkCall) -> None:
        self.framework = call.framework
        strategy = getattr(call.trainer, "strategy", None)
        if call.framework != "lightning" or strategy is None:
            return
        self.lightning = True
        self.strategy = type(strategy).__name__
        launcher = type(getattr(strategy, "launcher", None)).__name__
        self.spawn = launcher == "_MultiProcessingLauncher"
        self.manual_optimization = not bool(getattr(call.model, "automatic_optimization", True))

    @property
    def ddp_name(self) -> str:
        """The Lightning strategy name without the unused-parameter search."""
        return "ddp_spawn" if self.spawn else "ddp"
