"""Real-shaped chat templates (abridged from the models' tokenizer_config.json: their structure, special
tokens and whitespace handling kept) for tests/openai."""

# Qwen3: <|im_start|>role\n...<|im_end|>, a system message first, reasoning_content, enable_thinking
QWEN3 = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools><|im_end|>\\n\" }}\n"
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n        {%- set content = message.content %}\n"
    "    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- endif %}\n"
    "        {%- if reasoning_content %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")

# Gemma: bos_token first, no system role (folded into the first user turn), "model" for assistant
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

# Llama 3.1: bos_token, a dated system header (strftime_now), headers per role, <|eot_id|>
LLAMA3 = (
    "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n")

TEMPLATES = {
    "qwen3": (QWEN3, {"bos_token": None, "eos_token": "<|im_end|>"}, ["<|im_start|>", "<|im_end|>"]),
    "gemma": (GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>"}, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]),
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]),
}
