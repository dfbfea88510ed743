"""The class users name in vLLM's --kv-transfer-config:

    {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector", ...}
"""

from kv_connector.simple_connector import SimpleConnector as MooncakeConnector

__all__ = ["MooncakeConnector"]
