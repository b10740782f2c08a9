"""OffloadedAdamW under Hugging Face's Trainer, as docs/python.md ("With Hugging Face's
Trainer") shows it: optimizers=(OffloadedAdamW(...), scheduler). A tiny LlamaForCausalLM
made from a config trains a few steps on the CPU; the losses are finite and fall, and
the optimizer counted every step. Skipped where transformers or accelerate (which the
Trainer needs) does not import: Debian's python has neither.
"""
import importlib
import inspect
import math

import pytest

import torch

import memascend.torch as mt

try:  # a skipped test rather than a module skipped: pytest then exits 0 (ctest: skipped)
    importlib.import_module("accelerate")  # transformers.Trainer needs it
    import transformers
    MISSING = None
except ImportError as e:
    transformers, MISSING = None, f"{e.name} is not installed (pip install transformers accelerate)"
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))

STEPS, SEQ, VOCAB = 6, 16, 128


class Tokens(torch.utils.data.Dataset):
    """The same few sequences over and over: a loss that must fall."""

    def __init__(self, n=8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = self.ids[i % len(self.ids)]
        return {"input_ids": ids, "labels": ids.clone()}


def cpu_args(tmp_path, **kw):
    """TrainingArguments on the CPU, across transformers versions (use_cpu, else no_cuda)."""
    params = inspect.signature(transformers.TrainingArguments).parameters
    kw["use_cpu" if "use_cpu" in params else "no_cuda"] = True
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, seed=0, **kw)


def test_trainer_trains_a_tiny_llama_with_offloaded_adamw(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    opt = mt.OffloadedAdamW(model.parameters(), lr=3e-3, weight_decay=0.0,
                            volume=str(tmp_path / "run.vol"))
    scheduler = transformers.get_linear_schedule_with_warmup(opt, 1, STEPS)
    trainer = transformers.Trainer(model=model, args=cpu_args(tmp_path),
                                   train_dataset=Tokens(), optimizers=(opt, scheduler))
    try:
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        assert len(losses) == STEPS, trainer.state.log_history
        assert all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0], losses
        assert opt.steps == STEPS and opt.skipped_steps == 0
        # The scheduler's lr reached the optimizer, and the state is the optimizer's.
        assert opt.param_groups[0]["lr"] == pytest.approx(scheduler.get_last_lr()[0])
        p = next(model.parameters())
        assert float(opt.state[p]["step"]) == STEPS
        opt.settle()
    finally:
        opt.close()
