"""A tau2-bench telecom results file, built here (no telecom log is in ../shared/data).

The layout is the one of the real tau2 airline results there ({timestamp, info, tasks[],
simulations[]}, flat tool calls with dict arguments, ``usage`` on every generated message, the
orchestrator's greeting without usage), plus what telecom adds: the user simulator operates its
own phone through tools, so user messages carry ``tool_calls`` (``requestor: "user"``) and tool
messages answer them (``requestor: "user"``). The agent never sees those: its prompt grows only
by the messages routed to it, which the ``prompt_tokens`` below follow.
"""

from __future__ import annotations

from typing import Any

POLICY = ("# Telecom agent policy\n"
          "You are a customer service agent for a mobile carrier. Verify the customer's "
          "identity (phone number or customer id) before any lookup. Never change a plan, "
          "suspend a line or issue a refund without the customer's explicit confirmation. "
          "For connectivity problems, walk the customer through the troubleshooting steps on "
          "their own device one at a time; transfer to a human agent only when they fail.")


def _call(cid: str, name: str, args: dict[str, Any], requestor: str) -> dict[str, Any]:
    return {"id": cid, "name": name, "arguments": args, "requestor": requestor}


def _result(cid: str, content: str, requestor: str) -> dict[str, Any]:
    return {"id": cid, "role": "tool", "content": content, "requestor": requestor,
            "error": False}


def _assistant(content: str | None, calls: list[dict[str, Any]] | None, prompt: int,
               completion: int) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": calls,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion}, "cost": 0.001}


def _user(content: str | None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"role": "user", "content": content, "tool_calls": calls,
            "usage": {"prompt_tokens": 700, "completion_tokens": 20}, "cost": 0.0005}


def simulation(sim_id: str, task_id: str, trial: int, fixed: bool) -> dict[str, Any]:
    """One telecom episode: the agent looks the line up, asks the user to check the phone;
    the user runs two of its own tools (status bar, airplane mode) between agent turns."""
    s = sim_id
    messages = [
        {"role": "assistant", "content": "Hi! How can I help you today?", "tool_calls": None,
         "usage": None, "cost": 0.0},
        _user("My phone has no service since this morning. My number is 555-0142."),
        _assistant(None, [_call(f"{s}-a1", "get_customer_by_phone",
                                {"phone_number": "555-0142"}, "assistant")], 2400, 24),
        _result(f"{s}-a1", '{"customer_id": "C1001", "line_status": "Active"}', "assistant"),
        _assistant("I found your line; it is active. Could you look at your status bar and "
                   "tell me what it shows?", None, 2450, 30),
        _user(None, [_call(f"{s}-u1", "check_status_bar", {}, "user")]),
        _result(f"{s}-u1", "Status Bar: Airplane Mode | Battery 80%", "user"),
        _user("It shows airplane mode is on."),
        _assistant("Please turn airplane mode off and tell me whether service returns.",
                   None, 2500, 18),
    ]
    if fixed:
        messages += [
            _user(None, [_call(f"{s}-u2", "toggle_airplane_mode", {}, "user")]),
            _result(f"{s}-u2", "Airplane Mode is now OFF. Signal: 4 bars (5G)", "user"),
            _user("Done, I have signal again. Thanks! ###STOP###"),
        ]
        reward, reason = 1.0, "user_stop"
    else:
        messages += [
            _user("I'd rather not touch settings. Can you fix it from your side?"),
            _assistant(None, [_call(f"{s}-a2", "transfer_to_human_agents",
                                    {"summary": "no service"}, "assistant")], 2540, 22),
            _result(f"{s}-a2", "Transfer successful", "assistant"),
        ]
        reward, reason = 0.0, "agent_stop"
    for turn, m in enumerate(messages):
        m["turn_idx"] = turn
    return {"id": sim_id, "task_id": task_id, "trial": trial, "seed": 300 + trial,
            "termination_reason": reason, "reward_info": {"reward": reward},
            "agent_cost": 0.01, "user_cost": 0.002, "messages": messages}


def results(n_tasks: int = 2, trials: int = 2) -> dict[str, Any]:
    tasks = [{"id": f"[mobile_data_issue]airplane_mode_on_{t}", "user_scenario": {
        "instructions": {"reason_for_call": "Your phone shows no service.",
                         "known_info": "Your phone number is 555-0142.",
                         "task_instructions": "Follow the agent's instructions on your phone."}}}
        for t in range(n_tasks)]
    sims = [simulation(f"sim-{t}-{k}", tasks[t]["id"], k, fixed=(k % 2 == 0))
            for t in range(n_tasks) for k in range(trials)]
    return {"timestamp": "2025-08-01T16:00:00",
            "info": {"num_trials": trials, "max_steps": 200,
                     "environment_info": {"domain_name": "telecom", "policy": POLICY,
                                          "tool_defs": {}}},
            "tasks": tasks, "simulations": sims}
