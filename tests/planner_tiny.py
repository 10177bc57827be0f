"""The planner tests' tiny shape, written out by hand (tests/helpers.py's tiny Qwen3): test_planner.py and
test_planner_forms.py check the planner's terms against it."""
from ulysses_train.planner import ModelShape

# hidden 64, intermediate 128, 2 layers, 4 query heads / 2 KV heads of 16, vocab 256, tied (tests/helpers.py)
H, I, LAYERS, HEADS, KV_HEADS, D, V = 64, 128, 2, 4, 2, 16, 256
Q, KV = HEADS * D, KV_HEADS * D  # 64, 32
# one layer: q_proj 64x64, k_proj and v_proj 64x32, o_proj 64x64, three MLP matrices 64x128, two RMSNorms
# of 64, Qwen3's q_norm and k_norm of head_dim 16
LAYER_PARAMS = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 16  # 37,024
TOTAL_PARAMS = 2 * LAYER_PARAMS + 256 * 64 + 64  # layers, tied embedding, final norm: 90,496

TINY = ModelShape(name="tiny", hidden=H, intermediate=I, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                  head_dim=D, vocab=V, tied=True, layer_params=LAYER_PARAMS, total_params=TOTAL_PARAMS)
