/* Splitting a call's items into chunks for one parallel loop. */
#include <stdlib.h>

#include "kernel_internal.h"

static int64_t units_per_chunk(int64_t unit_len) {
  int64_t per = unit_len > 0 ? GEFEN_CHUNK_ELEMS / unit_len : 1;
  return per > 0 ? per : 1;
}

gefen_status gefen_work_plan(gefen_work_list *wl, const void *items, int64_t n,
                             gefen_units_fn units_of, gefen_error *err) {
  wl->items = NULL;
  wl->count = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t units, len;
    units_of(items, i, &units, &len);
    if (units <= 0 || len <= 0) continue;
    const int64_t per = units_per_chunk(len);
    total += (units + per - 1) / per;
  }
  wl->items = malloc((size_t)(total > 0 ? total : 1) * sizeof *wl->items);
  if (!wl->items) return gefen_fail(err, GEFEN_ENOMEM, "work plan: out of memory");
  for (int64_t i = 0; i < n; i++) {
    int64_t units, len;
    units_of(items, i, &units, &len);
    if (units <= 0 || len <= 0) continue;
    const int64_t per = units_per_chunk(len);
    for (int64_t b = 0; b < units; b += per) {
      gefen_work *w = &wl->items[wl->count++];
      w->item = i;
      w->begin = b;
      w->end = b + per < units ? b + per : units;
    }
  }
  return GEFEN_OK;
}

void gefen_work_free(gefen_work_list *wl) {
  free(wl->items);
  wl->items = NULL;
  wl->count = 0;
}
