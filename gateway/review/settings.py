"""The review page's settings (`TICKETQ_GATEWAY_REVIEW_*`), a part of `GatewaySettings` (which
inherits them: one settings object, read from the environment once); see docs/review.md."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr, field_validator


class ReviewSettings(BaseModel):
    """The review page's fields of `gateway.settings.GatewaySettings`."""

    gateway_review_secret: SecretStr | None = Field(None, description="Key signing review-page sessions (32+ "
        "characters, the same on every replica); unset: the review page (/review) is off.")  # fmt: skip
    gateway_review_session_s: int = Field(28800, ge=60, description="How long a review-page login lasts.")
    gateway_review_page_size: int = Field(20, ge=1, le=500, description="Review items shown per page, oldest first.")
    gateway_review_insecure_cookie: bool = Field(False, description="Send the review session cookie without "
        "`Secure` (plain HTTP: a local test only).")  # fmt: skip
    gateway_review_deliver: bool = Field(False, description="Also add each reviewed result (the reviewer's labels) "
        "to the results stream, where ticketq-deliver POSTs it like any result.")  # fmt: skip

    @field_validator("gateway_review_secret")
    @classmethod
    def _check_review_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters (`openssl rand -hex 32`)")
        return value
