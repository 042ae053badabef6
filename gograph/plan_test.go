package gograph

import (
	"strings"
	"testing"
)

func planOf(t *testing.T, order, layers string, n, m int, training bool, warm int) int64 {
	t.Helper()
	h, err := PlanSchedule(order, layers, n, m, training, warm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = FreePlan(h) })
	return h
}

func TestPlanScheduleDefault(t *testing.T) {
	h := planOf(t, "", "", 2, 2, true, 3)
	got, err := PlanSteps(h)
	if err != nil {
		t.Fatal(err)
	}
	want := "schedule v1 ordered=0 chunks=1 microbatches=1 callables=2 passes=2 layers=2\n" +
		"F 0 0 -1 0 0 0\nF 1 1 -1 0 1 0\nB 1 1 -1 0 1 0\nB 0 0 -1 0 0 0\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	if _, err := PlanSchedule("", "", 2, 3, true, 3); err == nil || !strings.Contains(err.Error(), "invalid schedule: expected sample_args to have the same length as callables") {
		t.Errorf("sample_args mismatch: %v", err)
	}
	if _, err := PlanSchedule("", "2", 2, 2, true, 3); err == nil || !strings.Contains(err.Error(), "invalid schedule: _num_layers_per_chunk needs _order") {
		t.Errorf("layers without order: %v", err)
	}
}

func TestPlanScheduleOrdered(t *testing.T) {
	h := planOf(t, "1,2,-2,-2.5,-1,-1.5", "1,1", 2, 2, true, 1)
	got, _ := PlanSteps(h)
	lines := strings.Split(strings.TrimSpace(got), "\n")
	want := []string{
		"schedule v1 ordered=1 chunks=2 microbatches=1 callables=2 passes=2 layers=1,1",
		"F 0 0 0 1 0 0", "F 1 1 1 2 0 0", "B 1 1 2 2 0 0", "W 1 1 3 2 0 0", "B 0 0 4 1 0 0", "W 0 0 5 1 0 0",
	}
	if strings.Join(lines, "|") != strings.Join(want, "|") {
		t.Errorf("got %q", lines)
	}
	_, err := PlanSchedule("1,-2,2,-1", "", 2, 2, true, 3)
	if err == nil || !strings.HasPrefix(err.Error(), "plan_schedule: invalid schedule: _order entry 1 (-2): backward of chunk 2") {
		t.Errorf("bad order: %v", err)
	}
}

func TestPlanWarmupAndCapture(t *testing.T) {
	h := planOf(t, "", "", 2, 2, true, 2)
	perCallable := "op f 0\nop b 0\nop x 0\nop g 0\nop f 1\nop b 1\nop x 1\nop g 1\n"
	inOrder := "op f 0\nop y 0\nop f 1\nop b 1\nop x 1\nop g 1\nop b 0\nop x 0\nop g 0\n"
	for _, tc := range []struct {
		name                      string
		hooks, wholeStep, ownPool bool
		want                      string
	}{
		{"torch's loop", false, false, true, "warmup v1 pool=0\n" + perCallable},
		{"capture-time hooks: the schedule's order", true, false, true, "warmup v1 pool=0\n" + inOrder},
		{"the whole step in a pool of its own: in order, in the pool", false, true, true, "warmup v1 pool=1\n" + inOrder},
		{"the whole step in a pool passed in: torch's loop", false, true, false, "warmup v1 pool=0\n" + perCallable},
		{"the whole step with hooks: on the side stream", true, true, true, "warmup v1 pool=0\n" + inOrder},
	} {
		got, err := PlanWarmup(h, 1, tc.hooks, tc.wholeStep, tc.ownPool)
		if err != nil || got != tc.want {
			t.Errorf("%s: warmup = %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
	facts := "facts v1\npass 0 1 0 1 -1 -1\nin 0 0 0 1 1\nout 0 1 1\npass 1 1 0 1 -1 -1\nin 1 1 1 1 1\nout 1 1 1\n"
	got, err := PlanCapture(h, facts, false, true, true, false)
	want := "program v1\nop F 0\nop F 1\nop B 1\nop X 1\nop B 0\nop X 0\nop R d 1 0\nop H -1\n" +
		"lent F 0 8\nlent F 1 8\nlent B 1 8\nlent B 0 8\nin 1 0 c 0 0\ngout 0 0 c 1 0\nslots 0\n"
	if err != nil || got != want {
		t.Errorf("chained capture =\n%s, %v\nwant\n%s", got, err, want)
	}
	for _, bad := range []struct {
		plan  int64
		facts string
		want  string
	}{
		{0, "", "plan_capture: unknown plan handle 0"},
		{h, "pass 0 1 0 1 -1 -1\n", `plan_capture: facts: the text starts with "pass 0 1 0 1 -1 -1", not the header "facts v1"`},
		{h, "facts v2\n", `plan_capture: facts: the text starts with "facts v2"`},
		{h, "facts v1\nin 7 0 0 0 0", "plan_capture: facts line 0"},
		{h, "facts v1\npass 0 0 1 0 -1 -1", "plan_capture: pass 0 has a weight-gradient graph but no backward graph"},
	} {
		if _, err := PlanCapture(bad.plan, bad.facts, true, false, false, false); err == nil || !strings.HasPrefix(err.Error(), bad.want) {
			t.Errorf("PlanCapture(%d, %q): %v, want %q", bad.plan, bad.facts, err, bad.want)
		}
	}
	if _, err := PlanWarmup(h, -1, false, false, true); err == nil {
		t.Error("negative warmup iterations accepted")
	}
}

func TestPlanHandles(t *testing.T) {
	before := LivePlans()
	h, _ := PlanSchedule("", "", 1, 1, false, 0)
	if LivePlans() != before+1 {
		t.Fatalf("LivePlans = %d", LivePlans())
	}
	if known, _ := FreePlan(h); !known {
		t.Fatal("FreePlan of a live plan reported unknown")
	}
	if known, _ := FreePlan(h); known {
		t.Fatal("FreePlan twice reported known")
	}
	if _, err := PlanSteps(h); err == nil || !strings.Contains(err.Error(), "plan_steps: unknown plan handle") {
		t.Fatalf("PlanSteps after free: %v", err)
	}
	if LivePlans() != before {
		t.Fatalf("LivePlans = %d, want %d", LivePlans(), before)
	}
}

func TestPlanMemory(t *testing.T) {
	h := planOf(t, "", "", 1, 1, true, 1)
	facts := "facts v1\npass 0 1 0 1 -1 -1\nin 0 0 1 1 1\nout 0 0 1\n"
	trace := "trace v1\nstep 0 f 0\na 1 67108864 0\na 2 67108864 0\nstep 1 b 0\nr 1 1\na 3 67108864 1\nstep 2 x 0\nr 2 -1\nr 3 -1\nout 0 0 2\ngrad 0 0 3\n"
	if _, err := PlanMemory(h, trace); err == nil || !strings.Contains(err.Error(), "plan_memory: plan handle 1") && !strings.Contains(err.Error(), "no capture program yet") {
		t.Errorf("PlanMemory before PlanCapture: %v", err)
	}
	if _, err := PlanCapture(h, facts, false, false, true, false); err != nil {
		t.Fatal(err)
	}
	got, err := PlanMemory(h, trace)
	if err != nil || !strings.HasPrefix(got, "prediction v1\nseed 0\npool 134217728 134217728 134217728 2\nwarmup 134217728 134217728 0\nop F 0 134217728 134217728\n") {
		t.Errorf("PlanMemory = %q, %v", got, err)
	}
	for _, bad := range []struct {
		plan  int64
		trace string
		want  string
	}{
		{0, trace, "plan_memory: unknown plan handle 0"},
		{h, "step 0 f 0\n", `plan_memory: trace: the text starts with "step 0 f 0", not the header "trace v1"`},
		{h, "trace v1\na 1 1 5", "plan_memory: trace line 1"},
		{h, "trace v1\na 1 1 -1\na 1 1 -1", "plan_memory: warmup: allocsim: allocation 1 is already live"},
	} {
		if _, err := PlanMemory(bad.plan, bad.trace); err == nil || !strings.HasPrefix(err.Error(), bad.want) {
			t.Errorf("PlanMemory(%d, %q): %v, want %q", bad.plan, bad.trace, err, bad.want)
		}
	}
}
