"""The module users name in vLLM's --kv-transfer-config (the class is defined in ``kv_connector/connector.py``):

    {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector", ...}
"""

from kv_connector.connector import MooncakeConnector

__all__ = ["MooncakeConnector"]
