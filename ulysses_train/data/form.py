"""How a corpus's rows become documents and documents become sequences: the options of `build_packed_dataset`
beyond the source and the tokenizer, in one value that the trainer (from the run config's `data` section) and
`scripts/prepare_data.py` (from its flags) build alike, so both find the same cache."""
from __future__ import annotations

from dataclasses import dataclass, field

from ulysses_train.errors import ConfigError

DATA_FORMATS = ("text", "chat")
LOSS_ON = ("auto", "assistant", "all")
PACKING_MODES = ("glue", "documents")
TOO_LONG_RULES = ("split", "truncate", "drop")


def resolved_loss_on(data) -> str:
    """data.loss_on with auto resolved: assistant for chat sessions, all for text (`data`: a run config's data
    section or a DataForm)."""
    if data.loss_on != "auto":
        return data.loss_on
    return "assistant" if data.format == "chat" else "all"


@dataclass(frozen=True)
class DataForm:
    format: str = "text"
    """text: a string column (or .txt files), one document per row; chat: a column of message lists."""
    text_field: str = "text"
    messages_field: str = "messages"
    loss_on: str = "auto"
    """auto | assistant | all; `learned` resolves auto."""
    packing: str = "glue"
    too_long: str = "split"
    drop_last: bool = False
    flags: bool = field(default=False, compare=False)
    """Whether the user sets these as prepare_data.py flags (errors then name --text-field, not data.text_field)."""

    def __post_init__(self):
        for name, value, choices in (("format", self.format, DATA_FORMATS), ("loss_on", self.loss_on, LOSS_ON),
                                     ("packing", self.packing, PACKING_MODES),
                                     ("too_long", self.too_long, TOO_LONG_RULES)):
            if value not in choices:
                raise ConfigError(f"{self.option(name)}={value!r} is not valid; choose one of {', '.join(choices)}.")
        if self.packing == "glue" and self.too_long != "split":
            # glue runs documents end to end and cuts at sequence edges: an over-long document (a chat session)
            # continues in the next sequence, so truncate or drop would silently not happen; refused, not warned,
            # because a warning scrolls by while the run trains on the pieces the user meant to leave out
            raise ConfigError(f"{self.option('too_long')}={self.too_long} needs {self.option('packing')} "
                              f"documents; {self.option('packing')} glue cuts every document at sequence edges "
                              f"(a long one continues in the next sequence), so nothing would be "
                              f"{'dropped' if self.too_long == 'drop' else 'truncated'}. Fix: set "
                              f"{self.option('packing')} documents, or leave {self.option('too_long')} at split.")
        if self.format == "text" and self.loss_on == "assistant":
            raise ConfigError(f"{self.option('loss_on')}=assistant needs chat data ({self.option('format')} chat); "
                              f"text documents have no assistant turns. Use {self.option('loss_on')} all (or auto).")

    @classmethod
    def from_config(cls, data) -> "DataForm":
        """From a run config's `data` section (`config.DataConfig`)."""
        return cls(format=data.format, text_field=data.text_field, messages_field=data.messages_field,
                   loss_on=data.loss_on, packing=data.packing, too_long=data.too_long, drop_last=data.drop_last)

    @property
    def chat(self) -> bool:
        return self.format == "chat"

    @property
    def field(self) -> str:
        """The column each document is read from."""
        return self.messages_field if self.chat else self.text_field

    @property
    def field_option(self) -> str:
        return self.option("messages_field" if self.chat else "text_field")

    @property
    def learned(self) -> str:
        """loss_on with auto resolved (resolved_loss_on): assistant for chat, all for text."""
        return resolved_loss_on(self)

    def option(self, name: str) -> str:
        """How the user sets `name`: `data.too_long` in a run config, `--too-long` as a flag."""
        return f"--{name.replace('_', '-')}" if self.flags else f"data.{name}"

    def tokens_identity(self) -> dict:
        """What decides the tokens stage (with the corpus and the tokenizer)."""
        out = {"format": self.format, "field": self.field}
        return out | ({"loss_on": self.learned} if self.chat else {})

    def packing_identity(self) -> dict:
        """What decides the packed stage (with the tokens stage, seq_length and the pad id)."""
        if self.packing == "glue":
            return {"drop_last": self.drop_last}  # the key the glue stage had before documents packing existed
        return {"packing": self.packing, "too_long": self.too_long}
