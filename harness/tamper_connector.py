"""The connector test instances name (``harness.vllm.connector_config`` with ``tamper=True``): the
product's ``MooncakeConnector`` plus the test switches of harness/tamper.py."""

from __future__ import annotations

from typing import Any

from harness.tamper import install, switch_of
from kv_connector.mooncake_connector import MooncakeConnector as _MooncakeConnector


class MooncakeConnector(_MooncakeConnector):
    """The product's connector; a consumer's scheduler side passes each load's switch to the workers with the step's
    metadata (``meta.tamper``: plain data, pickled with it), which set it before the step's loads start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._switches: dict[str, bool | str] = {}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        switch = switch_of(request.kv_transfer_params)
        if switch is not None:
            self._switches[request.request_id] = switch

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        meta.tamper = {load.req_id: self._switches.pop(load.req_id) for load in meta.loads
                       if load.req_id in self._switches}
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        switches = getattr(self._meta(), "tamper", None)
        if switches:
            install(self._worker, switches)
        super().start_load_kv(forward_context, **kwargs)
