"""vLLM tool-parser plugin: the `glm46` parser, vLLM's own `glm45` parser without GLM-4.7's call grammar.

task=serve passes this file to vLLM (`--tool-parser-plugin <this file> --tool-call-parser glm46`); vLLM imports it in
its own venv, so it imports nothing of glm46.

Why: from vLLM 0.32 on, `glm45` names GLM-4.7's parser (vllm/tool_parsers/__init__.py maps it to
Glm47MoeModelToolParser), which constrains every call of a request that lists tools to GLM-4.7's layout
(`structural_tag_model = "glm_4_7"`: `<tool_call>name<arg_key>..</arg_key><arg_value>..`, with
`default_tool_strict_level` FUNCTION, which `--tool-strict-level auto` does not lower). GLM-4.5/4.6 and glm46's
exports write `<tool_call>name\\n<arg_key>..</arg_key>\\n<arg_value>..</arg_value>\\n</tool_call>`: forced into the
other layout, a model loses its way (the tools recipe's model answered `What is 4821 * 37?` with the expression
`%\\n`). The parser itself reads both layouts, so `glm46` keeps it and drops the grammar. On a vLLM whose `glm45` sets
no grammar, `glm46` is `glm45` unchanged.
"""

try:
    from vllm.tool_parsers import ToolParserManager
except ImportError:  # older vLLM releases kept the tool parsers under its OpenAI server
    from vllm.entrypoints.openai.tool_parsers import ToolParserManager

GLM45 = ToolParserManager.get_tool_parser("glm45")


@ToolParserManager.register_module("glm46")
class Glm46ToolParser(GLM45):
    """GLM-4.5/4.6's calls parsed as `glm45` parses them, decoded without a grammar of GLM-4.7's layout."""

    structural_tag_model = None
    default_tool_strict_level = None
