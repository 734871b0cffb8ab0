"""Subclasses of vLLM classes that patches register by name ("module:Class").

vLLM imports these only when it builds the model or the connector, in the process that needs them, so
the plugin itself stays cheap to load and never imports vLLM's model code in the API process.
"""
