"""Chat templates for tests: the tiny test tokenizer's own template has no tool support."""

# ChatML with tool calling, after Qwen2.5's template: tools listed in the system turn, consecutive tool results
# grouped into one user turn. Newlines after block tags are written as expressions: transformers renders with
# trim_blocks, which would drop them.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n</tools>\n' }}"
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif not (loop.first and message.role == 'system') %}"
    "{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# TOOL_TEMPLATE asking for calls in Llama 3.1's format (a bare JSON object with "parameters"), which no <tool_call>
# block carries: it shows the tools, but a call written as it asks is never read.
OTHER_CALL_FORMAT_TEMPLATE = TOOL_TEMPLATE.replace(
    'Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
)
assert OTHER_CALL_FORMAT_TEMPLATE != TOOL_TEMPLATE

# After Gemma 3's template: roles must alternate from a user turn (a system message joins the first user turn),
# the assistant is "model", contents trimmed.
ALTERNATING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + (message['content'] | trim) }}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# TOOL_TEMPLATE that, like Mistral's, needs each tool message's tool_call_id (and shows it to the model).
CALL_ID_TOOL_TEMPLATE = TOOL_TEMPLATE.replace(
    "{{ '\n<tool_response>\n' + message.content",
    "{% if message.tool_call_id is not defined %}{{ raise_exception('Tool messages need a tool_call_id') }}{% endif %}"
    "{{ '\n<tool_response id=' + message.tool_call_id + '>\n' + message.content",
)
assert CALL_ID_TOOL_TEMPLATE != TOOL_TEMPLATE

# Mistral's check: a tool message's tool_call_id must be 9 characters, or the template raises.
NINE_CHARACTER_ID_TEMPLATE = TOOL_TEMPLATE.replace(
    "{{ '\n<tool_response>\n' + message.content",
    "{% if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ '\n<tool_response id=' + message.tool_call_id + '>\n' + message.content",
)
assert NINE_CHARACTER_ID_TEMPLATE != TOOL_TEMPLATE
