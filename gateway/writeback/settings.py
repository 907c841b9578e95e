"""`ticketq-writeback`'s settings: the gateway's (broker, queue, the dispatcher's retry schedule:
TICKETQ_DELIVER_MAX_ATTEMPTS, _BACKOFF_S, _BACKOFF_MAX_S, _TIMEOUT_S, _CLAIM_IDLE_S, _CONCURRENCY)
plus its own, all `TICKETQ_WRITEBACK_*`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from gateway.settings import GatewaySettings, _pairs


class WritebackSettings(GatewaySettings):
    """Every field is `TICKETQ_<FIELD>` in the environment."""

    writeback_config: str | None = Field(
        None, description="TOML file of write-back targets: helpdesk, URL, label -> tags/group/fields."
    )
    writeback_secrets: Annotated[dict[str, SecretStr], NoDecode] = Field(
        default_factory=dict,
        description="API secrets per target: `zendesk=API_TOKEN,freshdesk=API_KEY` (`zendesk@acme=...` a tenant's).",
    )
    writeback_group: str = Field("ticketq-writeback", description="Consumer group of the write-back on the results.")
    writeback_consumer: str | None = Field(
        None, description="This write-back's consumer name, the same across restarts (default: the host name)."
    )
    writeback_metrics_port: int = Field(9109, ge=0, le=65535, description="Port of the write-back's /metrics; 0: off.")

    @field_validator("writeback_secrets", mode="before")
    @classmethod
    def _split_secrets(cls, value: object) -> object:
        return _pairs(value, "=")

    def for_dispatcher(self) -> WritebackSettings:
        """These settings as the dispatcher's loop reads them: its group, consumer and metrics port are ours."""
        return self.model_copy(update={"deliver_group": self.writeback_group,
                                       "deliver_consumer": self.writeback_consumer,
                                       "deliver_metrics_port": self.writeback_metrics_port})  # fmt: skip
