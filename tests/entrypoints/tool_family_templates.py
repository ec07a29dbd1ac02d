"""Minimal chat templates written after each model family's documented tool format (the
published templates, cut down to the parts about tools; no downloads), for the rendering and
auto-selection tests."""

# Llama 3.1 (JSON calls): tools in the system turn after "Environment: ipython"; a call is
# written as {"name", "parameters"}; "tool" (or "ipython") messages become the ipython role;
# one call per assistant turn, as Meta's template insists.
LLAMA31 = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}\
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system_message }}
{%- if tools is not none %}
{{- 'Given the following functions, respond with a JSON for a function call in the format \
{"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping %}{{- message.content | tojson }}\
{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- if not message.tool_calls | length == 1 %}\
{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '<|python_tag|>{"name": "' + tool_call.name + '", "parameters": ' }}
{{- tool_call.arguments | tojson }}{{- '}<|eom_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content \
+ '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{%- endif %}"""

# Llama 3.2 / Llama 4 pythonic: the system turn asks for [func_name1(params_name1=...)];
# each call's arguments written with Python's repr; results as the ipython role.
PYTHONIC = """{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
{{- 'If you decide to invoke any of the function(s), you MUST put it in the format of \
[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\
\\n\\nHere is a list of functions in JSON format that you can invoke.\\n' }}
{{- tools | tojson }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
{%- if message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n[' }}
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function %}
{{- tool_call.name + '(' }}
{%- for param in tool_call.arguments %}{{- param + '=' }}\
{{- '%r' | format(tool_call.arguments[param]) }}{%- if not loop.last %}, {% endif %}\
{%- endfor %}
{{- ')' }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content \
+ '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{%- endif %}"""

# Mistral v3 (Mistral-7B-Instruct-v0.3): tools before the last user turn, calls as a
# [TOOL_CALLS] JSON list with 9-character ids, results as [TOOL_RESULTS] naming the call id.
MISTRAL = """{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools is not none and (message == user_messages[-1]) %}\
{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- '[TOOL_CALLS] [' }}
{%- for tool_call in message.tool_calls %}
{%- set out = tool_call.function | tojson %}{{- out[:-1] }}
{%- if not tool_call.id is defined or tool_call.id | length != 9 %}\
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}\
{%- endif %}
{{- ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}
{%- endfor %}
{%- elif message.role == 'assistant' %}{{- ' ' + message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', ' }}
{%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}\
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}\
{%- endif %}
{{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

# Qwen3-Coder: tools in the system turn, calls as XML <function=...> blocks whose parameter
# values are strings as written and anything else as JSON, results as <tool_response>.
QWEN3_CODER = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool.function | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format:\
\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\
\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- for args_name, args_value in tool_call.arguments | items %}
{{- '<parameter=' + args_name + '>\\n' }}
{%- set args_value = args_value if args_value is string else args_value | tojson %}
{{- args_value + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Hermes / Qwen2.5: tools as JSON in <tools>, calls as <tool_call> JSON blocks, results as
# <tool_response> in a user turn.
HERMES = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call>\
</tool_call> XML tags.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
