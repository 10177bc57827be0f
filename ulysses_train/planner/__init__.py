"""The planner: predicted GPU and host memory, and step time, for one (model, length, layout, levers).

Why: a 1M-token run that dies of out-of-memory after loading is the worst failure this tool can have.
`plan()` does the arithmetic up front from the model's shapes alone (no weights), `check_fits()` refuses
a plan that exceeds the hardware and names the cheapest change that fits, `max_length()` finds the
longest sequence that fits, and `story()` walks the levers one at a time (full logits -> chunked loss
-> CPU offload -> TiledMLP -> sequence parallelism).

The modules, each on top of the previous ones:
- `options`: `PlanOptions` (a run's settings) and `PlanError`, the planner's one error type;
- `shapes`: `ModelShape`, the numbers of a model, read from its config and never from its weights;
- `result`: `Component` and `MemoryPlan`, the prediction and what follows from it (peak, fit, time);
- `layer`: what one decoder layer holds per token while recomputed and run backward;
- `estimate`: `plan()`, the estimate section by section (how the peak is found is explained there);
- `forward_only`: `plan_forward()`, the evaluation forward under no_grad (no checkpoints, gradients or optimizer
  states), with its own preflight check (`check_forward_fits`);
- `search`: valid sp values, `max_length`, the cheapest lever setting that fits, `check_fits`;
- `report`: the table, the one-line summary, the story;
- `run`: a trainer run's `Config` and DeepSpeed dict as `PlanOptions`, and this machine's memory.

Here: what the trainer (training/step.py, its preflight check) and scripts/plan.py use; tests and
benchmarks import the rest from the modules.
"""
from ulysses_train.planner.estimate import plan
from ulysses_train.planner.options import PlanError, PlanOptions
from ulysses_train.planner.report import story, story_table
from ulysses_train.planner.run import detect_hardware, options_from_run
from ulysses_train.planner.search import check_fits, longest_fitting, max_length
from ulysses_train.planner.shapes import ModelShape, load_model_shape

__all__ = ["ModelShape", "PlanError", "PlanOptions", "check_fits", "detect_hardware", "load_model_shape",
           "longest_fitting", "max_length", "options_from_run", "plan", "story", "story_table"]
