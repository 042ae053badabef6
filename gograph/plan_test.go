package gograph

import (
	"strings"
	"testing"
)

func TestPlanScheduleDefault(t *testing.T) {
	got, err := PlanSchedule("", "", 2, 2, true, 3)
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
	got, err := PlanSchedule("1,2,-2,-2.5,-1,-1.5", "1,1", 2, 2, true, 1)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(got), "\n")
	want := []string{
		"schedule v1 ordered=1 chunks=2 microbatches=1 callables=2 passes=2 layers=1,1",
		"F 0 0 0 1 0 0", "F 1 1 1 2 0 0", "B 1 1 2 2 0 0", "W 1 1 3 2 0 0", "B 0 0 4 1 0 0", "W 0 0 5 1 0 0",
	}
	if strings.Join(lines, "|") != strings.Join(want, "|") {
		t.Errorf("got %q", lines)
	}
	_, err = PlanSchedule("1,-2,2,-1", "", 2, 2, true, 3)
	if err == nil || !strings.HasPrefix(err.Error(), "plan_schedule: invalid schedule: _order entry 1 (-2): backward of chunk 2") {
		t.Errorf("bad order: %v", err)
	}
}

func TestPlanBuffers(t *testing.T) {
	plan, err := PlanSchedule("1,-1,1,-1", "1", 1, 2, true, 3)
	if err != nil {
		t.Fatal(err)
	}
	got, err := PlanBuffers(plan, "i 0 0\ng 0 0\no 0 0\ni 1 0\ng 1 0\no 1 0\nk 0 0 0\nk 1 0 0")
	if err != nil {
		t.Fatal(err)
	}
	// steps F0 B0 F1 B1: x0 slot 0, dy0 slot 1, y0 released after step 1,
	// x1 reuses slot 0 (or 1), dy1 the other; TE keeps 2 too.
	want := "assign 0 1 1 0 1 3\nsig 0 4 2 2\nslots 2\n"
	if got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
	for _, bad := range [][2]string{
		{"nonsense", "i 0 0"},
		{plan, "i 5 0"},
		{plan, "q 0 0"},
	} {
		if _, err := PlanBuffers(bad[0], bad[1]); err == nil || !strings.HasPrefix(err.Error(), "plan_buffers: ") {
			t.Errorf("PlanBuffers(%q, %q): %v", bad[0], bad[1], err)
		}
	}
}
