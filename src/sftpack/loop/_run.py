"""A built run: :class:`Run`, what :meth:`RunConfig.build() <sftpack.loop.RunConfig.build>` returns.

One lane for every run: the data (:mod:`._run_data`: text through the cache, or conversations
with images), the model, the eval set, the chosen path's source (a temporary prepack first for
``packing="offline"`` without ``prepacked``), :func:`~sftpack.loop.train`, then the report and
the model folder (:mod:`._run_end`). What a run says goes through its ``say`` (rank 0 only).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._options import ConfigError, Packing
from ._run_data import MediaData, TextData
from ._run_end import eval_samples, report, save
from ._run_parts import RunSettings

if TYPE_CHECKING:
    from ._loop import TrainResult
    from ._parts import Part

__all__ = ["Run"]

#: a stop signal: entered around the loop alone, it yields whether to stop at the end of a step
StopSignal = Callable[[], AbstractContextManager[Callable[[], bool]]]


def _quiet(line: str) -> None:
    """Says nothing."""


@contextlib.contextmanager
def _never() -> Iterator[Callable[[], bool]]:
    yield lambda: False


class Run:
    """A checked :class:`~sftpack.loop.RunConfig` ready to run: :meth:`run` trains and returns
    the :class:`~sftpack.loop._loop.TrainResult`.

    Attributes:
        config: the run's settings.
        images: whether the data holds images (:attr:`RunConfig.images`).
        rank, world: this process's data-parallel place (known once :meth:`run` has joined the group).
        stopped: the stop signal ended the loop early (:meth:`run`); ``saved``: the model folder
            written then (``None``: none).
    """

    def __init__(
        self,
        config: RunSettings,
        *,
        images: bool,
        say: Callable[[str], None] | None = None,
        mark: Callable[[str], None] | None = None,
    ) -> None:
        self.config, self.images = config, images
        self._say_all = say or _quiet
        self.say: Callable[[str], None] = self._say_all
        self.mark: Callable[[str], None] = mark or _quiet
        self.rank, self.world = 0, 1
        self.stopped = False
        self.saved: str | None = None
        self.data: TextData | MediaData = MediaData(self) if images else TextData(self)
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    def run(self, stop: StopSignal | None = None, parts: Sequence[Part] = ()) -> TrainResult:
        """Train: the data, the model, the source, the loop, the report and ``save_model``.
        ``parts``: the caller's own parts of the loop (:class:`~sftpack.loop.Part`: a logger of
        its own...), called after the run's and before its checkpoints
        (:func:`~sftpack.loop.train`'s ``parts``).
        ``stop``: a stop signal (``sftpack train``: SIGTERM) entered around the loop alone; when it
        says stop, the loop ends after its step, :attr:`stopped` is set, ``save_model`` is written
        when the run was complete or nothing else keeps it (no ``checkpoint_dir``), and the result
        is returned unreported."""
        error: BaseException | None = None
        try:
            source, model, held = self._prepare()
            result = self._train(source, model, held, stop or _never, parts)
            if self.stopped:
                self.data.abort(None)
                return result
            self.data.finish()
            report(self, result)
            if self.config.output.save_model is not None:  # a text run's tokenizer is loaded here only for it
                save(self, result, **self.data.saving())
            return result
        except BaseException as e:
            error = e
            raise
        finally:
            if self._workdir is not None:
                self._workdir.cleanup()
            if error is not None:
                self.data.abort(error)

    def _prepare(self) -> tuple[Any, Any, Any]:
        """Everything before the first step: ``(source, model, eval samples)``."""
        cfg = self.config.train
        self.data.begin()  # before torch loads: a process forked now is safe
        self.mark("tokenizer")
        from ._loop import resolve_device  # start-up: torch loads after data.begin() forks the tokenizer's process
        from ._setup import make_source, model_cost  # start-up: loads torch, after data.begin()

        self.mark("imports")
        try:
            resolve_device(cfg.device)
        except ValueError as e:
            raise ConfigError(f"{{device}} {e}") from None
        self._join()
        self.data.load()
        model = self.data.early_model()
        self.mark("model")
        samples = self.data.samples()
        # the held-out share of the conversations (all tokenized: no streaming with it), or the eval file's
        samples, held = eval_samples(self, samples, self.data.tokenize)
        if model is None:
            model = self.data.model()
            self.mark("model")
        prepacked = self.config.data.prepacked
        if prepacked is None and cfg.packing is Packing.OFFLINE:
            prepacked = self._temporary_prepack(*self.data.prepack(samples))
        source = make_source(
            cfg,
            samples=samples,
            prepacked=prepacked,
            rank=self.rank,
            world=self.world,
            model_cost=model_cost(model),  # each step's work dealt to the ranks by this model's cost
            **self.data.source_settings(),
        )
        if self.data.streaming:  # the first step's conversations (data with no target at all is refused here)
            source.wait_first()  # type: ignore[attr-defined]
        self.mark("source")
        for line in self.data.model_lines(model):
            self.say(line)
        return source, model, held

    def _join(self) -> None:
        """A fresh run's ``checkpoint_dir`` checked (another run's checkpoints: refused before the
        data is waited for), then ``torch.distributed`` joined; ``say`` says on rank 0 only."""
        from ._checkpoint import check_new_run  # start-up: loads torch, after data.begin() forks
        from ._loop import init_distributed  # start-up: loads torch, after data.begin() forks

        out = self.config.output
        if out.checkpoint_dir and not self.config.resume and not out.overwrite_checkpoints:
            check_new_run(out.checkpoint_dir)
        self.rank, self.world = init_distributed()
        self.say = self._say_all if self.rank == 0 else _quiet

    def _train(self, source: Any, model: Any, held: Any, stop: StopSignal, parts: Sequence[Part]) -> TrainResult:
        """:func:`~sftpack.loop.train` under the run's settings, ``stop`` entered around it."""
        from ._loop import train  # start-up: loads torch; `import sftpack.loop._run` (RunConfig.build) must not

        out = self.config.output
        self.mark("train")  # start-up is over: from here a stop signal ends the loop at the end of a step
        with stop() as stopping:
            result = train(
                self.config.train,
                source=source,
                model=model,
                log=out.log,
                checkpoint_dir=out.checkpoint_dir,
                resume=self.config.resume,
                overwrite=out.overwrite_checkpoints,
                stop=stopping,
                progress=self.rank == 0 and out.progress,
                on_step=lambda rec: self.mark(f"step {rec.step}") if rec.step == 1 else None,
                eval_samples=held,
                tensorboard=out.tensorboard,
                parts=parts,
            )
        if stopping():
            self.stopped = True
            complete = not result.stopped  # it came in the last step
            if out.save_model is not None and (complete or not out.checkpoint_dir):
                self.saved = save(self, result, **self.data.saving())
        return result

    def _temporary_prepack(self, samples: Any, settings: dict[str, Any]) -> str:
        """The tokenized ``samples`` written as the run's temporary prepack (``settings``:
        :func:`~sftpack.offline.prepack_samples`' others, the images' with them): its path,
        removed when the run ends. Nothing is tokenized here."""
        from ..offline import prepack_samples  # start-up: the offline path loads torch; only for a temporary prepack

        cfg = self.config.train
        self._workdir = tempfile.TemporaryDirectory(prefix="sftpack-train-")
        path = prepack_samples(
            samples,
            Path(self._workdir.name) / "rows",
            max_seq_len=cfg.row_width,  # a preference run's rows: two sequences of max_seq_len each
            pad_multiple=cfg.pad_multiple,
            seed=cfg.seed,
            **settings,
        ).path
        self.say(f"prepacked into {path} (temporary; sftpack prepack writes a lasting one)")
        return str(path)
