"""The strategy hooks that hand the model to ``ModelTransform``, shared by every strategy.

A mixin placed before the Lightning strategy in the bases, so each hook runs the transform around Lightning's
own (``super()``). Its base ``TransformArguments`` takes the model arguments; each strategy's own ``__init__``
takes only its own and passes the rest on (``**kwargs``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from pl_lowprec._hparams import path_globals
from pl_lowprec.callbacks.epoch_end_resumption import as_saved_at_the_last_batch
from pl_lowprec.callbacks.replacements import use_package_callbacks
from pl_lowprec.callbacks.step_boundary_checkpoint import mid_step_resumption
from pl_lowprec.distributed.equal_batches import check_equal_batches
from pl_lowprec.distributed.launched_ranks import mark_failing, mark_running
from pl_lowprec.generator_states import set_random_states
from pl_lowprec.memory.budget import check_memory_budget, first_training_batch, training_loader
from pl_lowprec.memory.collectives import gradient_as_bucket_view
from pl_lowprec.memory.sizing_batch import sizing_batch
from pl_lowprec.plugins.anomaly_mode import overflows_left_to_the_scaler
from pl_lowprec.strategies.auto_settings import choose_memory_settings, run_interconnect
from pl_lowprec.strategies.finder_resumption import check_no_finder_when_resuming
from pl_lowprec.strategies.garbage_collection import freeze_long_lived_objects, unfreeze
from pl_lowprec.strategies.interrupted_batch import CHECKPOINT_KEY as INTERRUPTED_BATCH
from pl_lowprec.strategies.interrupted_batch import interrupted_batch, interrupted_batch_paragraph
from pl_lowprec.strategies.optimized_parameters import check_optimizers_train_the_model
from pl_lowprec.strategies.optimizer_record import CHECKPOINT_KEY as OPTIMIZERS
from pl_lowprec.strategies.optimizer_record import check_same_optimizer, optimizer_record
from pl_lowprec.strategies.random_states import CHECKPOINT_KEY as RANDOM_STATES
from pl_lowprec.strategies.random_states import (
    every_ranks_random_states,
    own_random_states,
    restart_epoch_iterator,
)
from pl_lowprec.strategies.rank_zero_search import on_rank_zero
from pl_lowprec.strategies.run_record import CHECKPOINT_KEY as RUN
from pl_lowprec.strategies.run_record import run_record, saved_run, warn_changed_run
from pl_lowprec.strategies.scheduler_arguments import built_arguments
from pl_lowprec.strategies.skipped_validation import CHECKPOINT_KEY as VALIDATION_FOLLOWS
from pl_lowprec.strategies.skipped_validation import (
    replay_the_skipped_validations_draws,
    validation_follows,
)
from pl_lowprec.strategies.step_clock import StepClock
from pl_lowprec.strategies.trainer_checks import check_trainer_arguments, check_validation_interval
from pl_lowprec.strategies.transform_args import TransformArguments
from pl_lowprec.strategies.unresumable_data import warn_unresumable_data
from pl_lowprec.strategies.validation_draws import ValidationDraws
from pl_lowprec.strategies.weight_averaging import check_weight_averaging
from pl_lowprec.transforms.weight_sources import teardown_with_meta


class TransformHooks(TransformArguments):
    """Runs ``self.transform`` at setup, around training steps, at the end of fit and for checkpoints."""

    _checked_before_loading = False
    _transformed_outside_fit = False  # validate/test/predict ran first: "auto" took its memory-saving side
    automatic_choice: Any = None  # the Search behind the "auto" settings, once fit has chosen them
    prediction: Any = None  # the MemoryEstimate of the settings fit runs, where "auto" or memory_budget made one
    step_clock: StepClock | None = None  # the run's optimizer steps, where there is a prediction to set them beside
    _frozen: tuple[int, float] | None = None
    _random_states_to_set: dict[str, Any] | None = None
    _validation_followed: bool | None = None  # after the checkpoint resumed from (``skipped_validation.py``)
    _resumed = False  # fit resumes from a checkpoint: on_train_start checks the training loader can
    _saved_run: dict[str, Any] | None = None  # the resumed checkpoint's settings (run_record.py)
    _built_schedulers: list[dict[str, Any]] | None = None  # as configure_optimizers built them (scheduler_arguments.py)
    _validation_draws: ValidationDraws | None = None  # the current validation's, inside a fit (validation_draws.py)
    _training_started = False  # this run's training loop has started: a checkpoint restored now is no resumption

    def setup(self, trainer: pl.Trainer) -> None:
        self.before_transform(trainer)
        self.transform.apply(self.lightning_module, self.precision_plugin, self.root_device)
        super().setup(trainer)

    def on_exception(self, exception: BaseException) -> None:
        """A failing rank 0 keeps its own exit status: Lightning's launcher would kill it when the other ranks fail
        the same way first (``distributed/launched_ranks.py``)."""
        mark_failing()
        super().on_exception(exception)

    def before_transform(self, trainer: pl.Trainer) -> None:
        """The start of every strategy's ``setup`` (the FSDP one has its own): this package's callbacks in place of
        Lightning's, then the checks before anything loads. A failure of an earlier run of this process is over."""
        mark_running()
        use_package_callbacks(trainer)
        self.check_before_loading(trainer)

    def check_before_loading(self, trainer: pl.Trainer) -> None:
        """Before the transform loads the model: in ``setup``, or earlier where ``fit`` resumes from a checkpoint
        (``load_model_state_dict``). The Trainer's arguments; then, once per strategy when fitting, the validation
        interval and the memory settings, which share one ask for the training loader."""
        check_trainer_arguments(trainer)
        self.transform.check_device(self.root_device)
        if trainer.state.fn != TrainerFn.FITTING and not self._transformed_outside_fit:
            self._transformed_outside_fit = True
            if self.transform_config.chooses_automatically:
                rank_zero_info(
                    f"Memory settings: 'auto' is chosen when fitting; {trainer.state.fn.value} runs the memory-saving"
                    " side (every declared block checkpointed, the exact memory-saving paths), whose numbers are the"
                    " fast side's up to rounding. A fit of this model after it keeps that side."
                )
        if trainer.state.fn != TrainerFn.FITTING:
            return
        check_weight_averaging(trainer, self.transform_config, self.transform.sharding is not None)
        if self._checked_before_loading:
            return
        self._checked_before_loading = True
        loader = functools.cache(lambda: training_loader(trainer))
        check_validation_interval(trainer, loader)
        self.settle_memory(trainer, loader)

    def settle_memory(self, trainer: pl.Trainer, loader: Callable[[], Any]) -> None:
        """The ``"auto"`` settings chosen for the device (``auto_settings.py``), then ``memory_budget=``; each
        from one batch of ``loader()``."""
        config = self.transform_config
        if self.memory_budget is None and not config.chooses_automatically:
            return
        plugin = self.precision_plugin
        if hasattr(plugin, "resolve"):  # AMPPrecision("auto") chooses for the device
            plugin.resolve(self.root_device)
        batch = first_training_batch(loader())  # one draw serves the choice and the budget's check
        batch, shape = sizing_batch(batch, trainer.datamodule)  # the longest batch the data makes, where it says
        rank_zero_info(f"Memory is sized for batches of {shape}.")
        links = run_interconnect(self)  # every rank, before a rank can fail alone
        search = None
        if config.chooses_automatically and self._transformed_outside_fit:  # installed already: apply keeps it
            rank_zero_info(
                "Memory settings: the model was transformed on the memory-saving side by an earlier validate, test or"
                " predict of this strategy, and this fit keeps it ('auto' chooses only for a model not transformed"
                " yet: fit first, or build the model and strategy again)."
            )
        elif config.chooses_automatically:
            search = choose_memory_settings(self, trainer, batch, str(plugin.precision), self.memory_budget, links)
            self.automatic_choice = search
            self.prediction = search.estimate if search is not None else None
        if self.memory_budget is None or (search is not None and search.fits):
            return  # the choice's line gave the peak within the budget
        check = functools.partial(
            check_memory_budget,
            self.memory_budget,
            self.lightning_module,
            batch,
            int(trainer.accumulate_grad_batches),
            str(plugin.precision),
            self.root_device,
            config,  # as given: the refusal's plan searches its "auto" settings, not the choice that did not fit
            self.transform.sharding,
            self.world_size,
            estimate=search.estimate if search is not None else None,
            gradient_as_bucket_view=gradient_as_bucket_view(self),
            simulated=[(chosen, estimate) for _, chosen, estimate in search.tried] if search is not None else (),
        )
        self.prediction = on_rank_zero(self, check, is_budget_refusal)  # the estimate, or its refusal, made once
        self.prediction.interconnect = links

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with self.transform.tensor_init_context(super().tensor_init_context(empty_init)):
            yield

    def teardown(self) -> None:
        unfreeze(self._frozen)
        self._frozen = None
        self._training_started = False  # the next run's checkpoint (fit(ckpt_path=...)) loads before its setup
        teardown_with_meta(self, super().teardown)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._built_schedulers = built_arguments(self.lr_scheduler_configs)  # before a checkpoint's state replaces them
        check_optimizers_train_the_model(self.lightning_module, self.optimizers)
        self.optimizers = self.transform.swap_optimizers(self.optimizers, self.lr_scheduler_configs, self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.transform.offloading(self.lightning_module, self.root_device):
            return super().training_step(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        """Under ``detect_anomaly=True``, an fp16 overflow is the loss scaler's to skip, whichever plugin scales
        (``plugins/anomaly_mode.py``)."""
        with overflows_left_to_the_scaler(self.precision_plugin):
            return super().backward(*args, **kwargs)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        self.transform.after_optimizer_step()
        if self.step_clock is not None:
            self.step_clock.tick()
        return output

    def on_train_start(self) -> None:
        super().on_train_start()
        check_equal_batches(self.lightning_module.trainer)
        if self._random_states_to_set is not None:  # resumed: as the uninterrupted run stood at this step
            trainer = self.lightning_module.trainer
            set_random_states(self._random_states_to_set)
            replay_the_skipped_validations_draws(trainer, self._validation_followed)  # before the next epoch's draws
            restart_epoch_iterator(trainer)
            self._random_states_to_set = None
        if self._resumed:
            warn_changed_run(self.lightning_module.trainer, self._saved_run, self._built_schedulers)
            warn_unresumable_data(self.lightning_module.trainer)
            self._resumed = False
        predicted = getattr(self.prediction, "step_time", None)  # nothing timed where nothing was predicted
        self.step_clock = StepClock(predicted) if predicted is not None else None
        self._training_started = True
        if self._frozen is not None:  # a tuner's trial steps started training once already in this fit
            return
        self._frozen = freeze_long_lived_objects()
        if self._frozen is not None:
            frozen, seconds = self._frozen
            rank_zero_info(
                f"Froze the {frozen:,} Python objects alive before the first step (gc.freeze, after one full"
                f" collection: {seconds:.1f} s): Python's full garbage collections skip them and no longer stall a"
                " step."
            )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._validation_draws is None:
            return super().validation_step(*args, **kwargs)
        with self._validation_draws.drawing():
            return super().validation_step(*args, **kwargs)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        self._validation_draws = ValidationDraws() if fitting else None
        if self.step_clock is not None:
            self.step_clock.pause()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.step_clock is not None:
            self.step_clock.resume()

    def on_train_end(self) -> None:
        super().on_train_end()
        self.transform.on_fit_end(self.lightning_module)
        line = self.step_clock.line() if self.step_clock is not None else None
        if line:
            rank_zero_info(line)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.transform.state_dict(self.lightning_module)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # resumed, not set yet (on_train_start): the resumed ones; every rank calls it, as it does this hook
        checkpoint[RANDOM_STATES] = every_ranks_random_states(self._random_states_to_set)
        checkpoint[VALIDATION_FOLLOWS] = validation_follows(self.lightning_module.trainer)
        checkpoint[OPTIMIZERS] = optimizer_record(self.optimizers, self.transform_config.optimizer)
        checkpoint[RUN] = run_record(self.lightning_module.trainer)
        checkpoint[INTERRUPTED_BATCH] = interrupted_batch(self.lightning_module.trainer, checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's, with ``pathlib`` paths in the hyperparameters readable under ``weights_only``
        (``_hparams.path_globals``)."""
        with path_globals():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def before_resuming(self, checkpoint: Mapping[str, Any]) -> None:
        """Where ``fit`` resumes from ``checkpoint``: a warning if it was saved inside an accumulated step, the loop
        state of one saved at a training epoch's end as Lightning resumes it exactly (``epoch_end_resumption.py``),
        and this rank's random states, set in ``on_train_start`` (``random_states.py``). A tuner callback would
        drop the checkpoint after its trial steps: refused (``finder_resumption.py``).

        Not where training has started already in this run: that restore is Lightning's tuners (``lr_find``,
        ``scale_batch_size``, their callbacks) putting back the model they saved before their trial steps. A
        resumption there would set the saved random states again at the next ``fit`` (over the user's
        ``torch.manual_seed``) and warn that a run "resumes at step 0" that never stopped."""
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or self._training_started:
            return
        check_no_finder_when_resuming(trainer)
        warning = interrupted_batch_paragraph(checkpoint, trainer.accumulate_grad_batches) or mid_step_resumption(
            checkpoint, trainer.accumulate_grad_batches
        )
        if warning:
            rank_zero_warn(warning)
        if isinstance(checkpoint, MutableMapping):
            as_saved_at_the_last_batch(checkpoint, trainer.max_steps)
        self._random_states_to_set = own_random_states(checkpoint, self.global_rank, self.world_size)
        self._validation_followed = checkpoint.get(VALIDATION_FOLLOWS)
        self._saved_run = saved_run(checkpoint, self.precision_plugin)
        self._resumed = True

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        check_same_optimizer(checkpoint, self.optimizers, self.transform_config.optimizer)
        super().load_optimizer_state_dict(checkpoint)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.check_before_loading(self.lightning_module.trainer)  # resuming: this runs before setup
        self.before_resuming(checkpoint)
        state_dict = checkpoint["state_dict"]  # where it sets every weight, pretrained= is not read
        self.transform.apply(self.lightning_module, self.precision_plugin, self.root_device, restored_next=state_dict)
        self.load_restored(state_dict, strict)

    def load_restored(self, state_dict: Mapping[str, Any], strict: bool) -> None:
        """Copy the checkpoint's state dict into the transformed module (``load_model_state_dict``'s last step, which
        a strategy holding the module in another form replaces)."""
        self.transform.load_state_dict(self.lightning_module, state_dict, strict=strict)


def is_budget_refusal(err: BaseException) -> bool:
    """``check_memory_budget``'s refusal (a ``ValueError``, one paragraph), raised on every rank in its words."""
    return isinstance(err, ValueError)
