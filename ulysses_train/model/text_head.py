"""A causal-LM class for a text model that transformers ships only inside its image-text model.

GLM-5.3-Flash's text model (`glm5_next_text`) exists in transformers (Glm5NextTextModel), but its only head is the
image-text Glm5NextForConditionalGeneration: AutoModelForCausalLM has no class for the text config. A family record
with `text_head` (families.py) gets one here: the text model under `model`, a bias-free `lm_head` (tied to the input
embeddings when the config says so), and transformers' own causal-LM loss in its forward, registered with
AutoModelForCausalLM for the text config's class. It is the image-text model's language path without the towers:
its tensors load from the release under the text model's names (image_text.IMAGE_TEXT_KEYS), and the trainer reads
only its decoder and lm_head (loading.LongContextCausalLM).

Registered when the package's model code is imported (architecture.py calls register_text_heads), in every process
that builds or plans a model; a transformers without the type (the GPU image's 5.17 has no glm5_next) registers
nothing, and the type is then refused as any unknown one."""
from __future__ import annotations

from ulysses_train.families import types_where


def text_head_types() -> tuple:
    """The text-model types whose causal-LM class is this module's (Family.text_head)."""
    return types_where(lambda family: family.text_head)


def causal_lm_class(text_model_class):
    """A causal-LM class around `text_model_class` (module docstring), named after it (Glm5NextTextModel ->
    Glm5NextTextForCausalLM), inheriting its pretrained base: the weight init, the fp32 modules and the checkpoint
    keys it ignores (GLM-5.3-Flash's multi-token-prediction layer) are the family's own."""
    import torch
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base = text_model_class.__mro__[1]  # the family's PreTrainedModel

    def __init__(self, config):
        base.__init__(self, config)
        self.model = text_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                logits_to_keep=0, **kwargs):
        """The text model, the lm_head on the last `logits_to_keep` positions (0: all), and with `labels`
        transformers' causal-LM loss (shifted inside), as its ForCausalLM classes compute it."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, **kwargs).last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    name = text_model_class.__name__.removesuffix("Model") + "ForCausalLM"
    return type(name, (base, GenerationMixin), {
        "__init__": __init__, "forward": forward, "config_class": text_model_class.config_class,
        "_tied_weights_keys": {"lm_head.weight": "model.embed_tokens.weight"}, "__module__": __name__})


def register_text_heads() -> None:
    """Register causal_lm_class with AutoModelForCausalLM for every text_head type this transformers has (once)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    for model_type in text_head_types():
        if model_type not in CONFIG_MAPPING:
            continue
        config_class = CONFIG_MAPPING[model_type]
        if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
            AutoModelForCausalLM.register(config_class, causal_lm_class(MODEL_MAPPING[config_class]), exist_ok=True)
