/* The scheduler's per-output row hand-out in C (the engine core's hot loop at large batches).
 *
 * `hand_out_rows` does what `vllm_sampling_mask.core.scheduler._hand_out_rows_python` does for
 * every output of one step: the Python loop is the reference, this is the same loop without the
 * interpreter (its bytecode, not its objects: every streamed row is still one bytes object, every
 * held row is written into its request's buffers). Both are compared on the same steps by
 * tests/test_native_loops.py. Built where a C compiler and Python's headers are found (an
 * optional extension, setup.py); without it the scheduler runs the Python loop.
 *
 * Every index and offset is checked: a step whose rows don't fit its blob raises instead of
 * handing out a wrong row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../_slot_fields.h"

static PyObject *str_sampling_mask;

/* The fields the loop reads of every output, at their slot offsets (EngineCoreOutput: msgspec). */
enum { NEW_TOKEN_IDS, REQUEST_ID, FINISH_REASON };
static SlotFields output_fields;

/* The int at position r of a tuple or list of ints (-1 with an exception set on error). */
static Py_ssize_t
int_at(PyObject *seq, Py_ssize_t r)
{
    Py_ssize_t size = PyTuple_Check(seq) ? PyTuple_GET_SIZE(seq) : PyList_GET_SIZE(seq);
    if (r < 0 || r >= size) {
        PyErr_Format(PyExc_IndexError, "batch row %zd of a step with %zd rows", r, size);
        return -1;
    }
    PyObject *item = PyTuple_Check(seq) ? PyTuple_GET_ITEM(seq, r) : PyList_GET_ITEM(seq, r);
    return PyNumber_AsSsize_t(item, PyExc_IndexError);
}

/* blob[start:end] as a new bytes object, or NULL (IndexError) where the row is not in blob. */
static PyObject *
row_of(PyObject *blob, Py_ssize_t start, Py_ssize_t end)
{
    if (start < 0 || end < start || end > PyBytes_GET_SIZE(blob)) {
        PyErr_Format(PyExc_IndexError, "row [%zd, %zd) outside the step's %zd bytes", start, end,
                     PyBytes_GET_SIZE(blob));
        return NULL;
    }
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(blob) + start, end - start);
}

/* A held request's rows since its last send (core.scheduler.HeldRows is the Python reference):
 * each row's id count (little-endian int32) at lengths[4 * i], its bytes at ids[fill:], in token
 * order, in two bytearrays with room after them (made for reserve_rows rows at a time, or twice
 * what they hold), cut to their rows and handed over by take().
 *
 * One object a request, read by the hand-out pass alone: its buffers' addresses and sizes are
 * kept here, so that a held row costs the pass this object's lines and its destinations' (the
 * bytearray objects are not read, no int object is made). The bytearrays are this object's
 * alone until take() hands them over, so nothing else resizes them under the kept addresses. */
typedef struct {
    PyObject_HEAD
    char *lengths_data, *ids_data; /* PyByteArray_AS_STRING of lengths and ids */
    Py_ssize_t num_rows, rows_room; /* rows held; rows lengths has room for */
    Py_ssize_t fill, ids_room;      /* bytes of ids written; bytes it has room for */
    Py_ssize_t reserve_rows;
    PyObject *lengths, *ids; /* bytearrays, or NULL before the first row and after take() */
} HeldRowsObject;

static PyTypeObject HeldRowsType;

/* size bytes in *buffer (a bytearray made where NULL), its address in *data: 0, or -1. */
static int
resize_buffer(PyObject **buffer, char **data, Py_ssize_t size)
{
    if (*buffer == NULL && (*buffer = PyByteArray_FromStringAndSize(NULL, 0)) == NULL)
        return -1;
    if (PyByteArray_Resize(*buffer, size) < 0)
        return -1;
    *data = PyByteArray_AS_STRING(*buffer);
    return 0;
}

/* Room in rows for one more row of size bytes: 0, or -1 with an exception set. Buffers grow to
 * room for reserve_rows rows like this one (or twice what they need), so that a request's are
 * allocated about once a send period, not every few rows as appending to a bytearray would (each
 * growth a copy of the rows so far). */
static int
held_rows_make_room(HeldRowsObject *rows, Py_ssize_t size)
{
    if ((size >> 2) > 0x7fffffff || size % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "a row of %zd bytes: not a whole number of int32 ids, "
                                       "or more than 2**31 - 1", size);
        return -1;
    }
    if (rows->num_rows == rows->rows_room) {
        Py_ssize_t room = rows->reserve_rows > 2 * (rows->num_rows + 1) ? rows->reserve_rows
                                                                       : 2 * (rows->num_rows + 1);
        if (resize_buffer(&rows->lengths, &rows->lengths_data, 4 * room) < 0)
            return -1;
        rows->rows_room = room;
    }
    if (rows->ids == NULL || rows->fill + size > rows->ids_room) { /* made for an empty row too */
        Py_ssize_t need = rows->fill + size;
        Py_ssize_t room = rows->reserve_rows * size > 2 * need ? rows->reserve_rows * size
                                                               : 2 * need;
        if (resize_buffer(&rows->ids, &rows->ids_data, room) < 0)
            return -1;
        rows->ids_room = room;
    }
    return 0;
}

/* Write a row of size bytes from src as row number `row` of rows, its bytes at ids_at. */
static void
held_rows_write(HeldRowsObject *rows, Py_ssize_t row, Py_ssize_t ids_at, const char *src,
                Py_ssize_t size)
{
    Py_ssize_t count = size >> 2;
    unsigned char *length = (unsigned char *)rows->lengths_data + 4 * row;
    length[0] = count & 0xff; /* little-endian whatever the host's order */
    length[1] = (count >> 8) & 0xff;
    length[2] = (count >> 16) & 0xff;
    length[3] = (count >> 24) & 0xff;
    memcpy(rows->ids_data + ids_at, src, size);
}

static PyObject *
held_rows_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"reserve_rows", NULL};
    Py_ssize_t reserve_rows;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:HeldRows", keywords, &reserve_rows))
        return NULL;
    if (reserve_rows < 1) {
        PyErr_SetString(PyExc_ValueError, "reserve_rows must be at least 1");
        return NULL;
    }
    HeldRowsObject *rows = (HeldRowsObject *)type->tp_alloc(type, 0);
    if (rows != NULL)
        rows->reserve_rows = reserve_rows;
    return (PyObject *)rows;
}

static void
held_rows_dealloc(HeldRowsObject *rows)
{
    Py_XDECREF(rows->lengths);
    Py_XDECREF(rows->ids);
    Py_TYPE(rows)->tp_free((PyObject *)rows);
}

static Py_ssize_t
held_rows_len(HeldRowsObject *rows)
{
    return rows->num_rows;
}

static PyObject *
held_rows_hold(HeldRowsObject *rows, PyObject *row)
{
    Py_buffer view;
    if (PyObject_GetBuffer(row, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (held_rows_make_room(rows, view.len) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    held_rows_write(rows, rows->num_rows++, rows->fill, view.buf, view.len);
    rows->fill += view.len;
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
held_rows_take(HeldRowsObject *rows, PyObject *Py_UNUSED(ignored))
{
    if (rows->num_rows == 0)
        Py_RETURN_NONE;
    /* Cut to the rows; where a cut fails the rows stay held, the room kept as it now is. */
    if (resize_buffer(&rows->lengths, &rows->lengths_data, 4 * rows->num_rows) < 0)
        return NULL;
    rows->rows_room = rows->num_rows;
    if (resize_buffer(&rows->ids, &rows->ids_data, rows->fill) < 0)
        return NULL;
    rows->ids_room = rows->fill;
    PyObject *taken = PyTuple_Pack(2, rows->lengths, rows->ids);
    if (taken == NULL)
        return NULL;
    Py_CLEAR(rows->lengths);
    Py_CLEAR(rows->ids);
    rows->lengths_data = rows->ids_data = NULL;
    rows->num_rows = rows->rows_room = rows->fill = rows->ids_room = 0;
    return taken;
}

static PyMethodDef held_rows_methods[] = {
    {"hold", (PyCFunction)held_rows_hold, METH_O,
     "hold(row): add a row (a bytes-like object: int32 little-endian ids)."},
    {"take", (PyCFunction)held_rows_take, METH_NOARGS,
     "take() -> (lengths, ids) | None: the rows held (two bytearrays cut to them), leaving none;\n"
     "None where none are held."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods held_rows_as_sequence = {.sq_length = (lenfunc)held_rows_len};

static PyTypeObject HeldRowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "vllm_sampling_mask.core._hand_out_native.HeldRows",
    .tp_doc = PyDoc_STR("HeldRows(reserve_rows): a held request's rows since its last send "
                        "(see core.scheduler.HeldRows)."),
    .tp_basicsize = sizeof(HeldRowsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = held_rows_new,
    .tp_dealloc = (destructor)held_rows_dealloc,
    .tp_as_sequence = &held_rows_as_sequence,
    .tp_methods = held_rows_methods,
};

/* A held row whose room is made during the pass (make_held_row) and whose bytes are written after
 * it (write_held_rows), named by its request's rows and its place in them, not by address: a
 * later row of the same request in the pass (not expected, but not ruled out) may move them. */
typedef struct {
    HeldRowsObject *rows; /* borrowed: held alive by held */
    Py_ssize_t row, ids_at;
    const char *src; /* in the step's blob */
    Py_ssize_t size;
} HeldRow;

/* Make room in rows for blob[start:end] as its next row; *row says where, for write_held_rows.
 *
 * Each request's buffers lie apart in memory, mostly out of the CPU's caches by the next step;
 * writing a row at once waits for its cache lines, one request after another. The room made,
 * the lines are prefetched instead, all of a step's at once, and written after the pass. */
static int
make_held_row(PyObject *rows_obj, PyObject *blob, Py_ssize_t start, Py_ssize_t end, HeldRow *row)
{
    if (!Py_IS_TYPE(rows_obj, &HeldRowsType)) {
        PyErr_SetString(PyExc_TypeError, "a held request's rows must be a HeldRows of "
                                         "_hand_out_native (core.scheduler.new_held_rows)");
        return -1;
    }
    HeldRowsObject *rows = (HeldRowsObject *)rows_obj;
    if (start < 0 || end < start || end > PyBytes_GET_SIZE(blob)) {
        PyErr_Format(PyExc_IndexError, "row [%zd, %zd) outside the step's %zd bytes", start, end,
                     PyBytes_GET_SIZE(blob));
        return -1;
    }
    Py_ssize_t n = end - start;
    if (held_rows_make_room(rows, n) < 0)
        return -1;
    *row = (HeldRow){rows, rows->num_rows++, rows->fill, PyBytes_AS_STRING(blob) + start, n};
    rows->fill += n;
#if defined(__GNUC__) || defined(__clang__)
    char *at = rows->ids_data + row->ids_at;
    for (Py_ssize_t line = 0; line < n; line += 64)
        __builtin_prefetch(at + line, 1);
    if (n > 0)
        __builtin_prefetch(at + n - 1, 1); /* a row need not start at a line */
    __builtin_prefetch(rows->lengths_data + 4 * row->row, 1);
#endif
    return 0;
}

/* Write the held rows made room for by make_held_row. */
static void
write_held_rows(const HeldRow *rows, Py_ssize_t num_rows)
{
    for (const HeldRow *row = rows; row < rows + num_rows; row++)
        held_rows_write(row->rows, row->row, row->ids_at, row->src, row->size);
}

/* 1 if output.finish_reason is not None, 0 if it is, -1 on error. */
static int
has_finished(PyObject *output)
{
    PyObject *reason = slot_field(&output_fields, output, FINISH_REASON);
    if (reason == NULL)
        return -1;
    int finished = reason != Py_None;
    Py_DECREF(reason);
    return finished;
}

/* The rows of one output with one new token (a held one made room for at held_rows[0], and
 * *num_held_rows counted); 0, or -1 on error. */
static int
hand_out_one(PyObject *output, PyObject *index, PyObject *held, PyObject *starts,
             PyObject *ends, PyObject *blob, int flush, PyObject *send,
             HeldRow *held_rows, Py_ssize_t *num_held_rows)
{
    PyObject *request_id = slot_field(&output_fields, output, REQUEST_ID);
    if (request_id == NULL)
        return -1;
    PyObject *batch_row = PyDict_GetItemWithError(index, request_id); /* borrowed */
    if (batch_row == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, request_id);
        Py_DECREF(request_id);
        return -1;
    }
    PyObject *rows = PyDict_GetItemWithError(held, request_id); /* borrowed */
    Py_DECREF(request_id);
    if (rows == NULL && PyErr_Occurred())
        return -1;
    Py_ssize_t r = PyNumber_AsSsize_t(batch_row, PyExc_IndexError);
    if (r == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t start = int_at(starts, r);
    if (start == -1 && PyErr_Occurred())
        return -1;
    if (rows == NULL && start < 0)
        return 0; /* opted out: no row (the field's default) */
    Py_ssize_t end = int_at(ends, r);
    if (end == -1 && PyErr_Occurred())
        return -1;
    if (rows == NULL) {
        PyObject *row = row_of(blob, start, end);
        if (row == NULL)
            return -1;
        int failed = PyObject_SetAttr(output, str_sampling_mask, row);
        Py_DECREF(row);
        return failed;
    }
    if (make_held_row(rows, blob, start, end, held_rows) < 0)
        return -1;
    ++*num_held_rows;
    int finished = flush ? 1 : has_finished(output);
    if (finished <= 0)
        return finished;
    return PyList_Append(send, output);
}

PyDoc_STRVAR(hand_out_rows_doc,
"hand_out_rows(outputs, index, held, starts, ends, blob, flush) -> (several, send)\n\n"
"For every output (a list of EngineCoreOutputWithMask) with one new token: set its\n"
"sampling_mask to its row, blob[starts[r]:ends[r]] (r = index[request_id]; no row where\n"
"starts[r] < 0: opted out), or, for a request in held (request id -> HeldRows), add the row\n"
"to its HeldRows. starts: tuple or list of int, ends: list of int, blob: bytes.\n"
"several: the outputs with more than one new token; send: the held requests' outputs that\n"
"carry their rows now (flush, or a finish), in order, for _send_held_rows.");

static PyObject *
hand_out_rows(PyObject *self, PyObject *args)
{
    PyObject *outputs, *index, *held, *starts, *ends, *blob;
    int flush;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!O!p:hand_out_rows", &PyList_Type, &outputs,
                          &PyDict_Type, &index, &PyDict_Type, &held, &starts, &PyList_Type,
                          &ends, &PyBytes_Type, &blob, &flush))
        return NULL;
    if (!PyTuple_Check(starts) && !PyList_Check(starts)) {
        PyErr_SetString(PyExc_TypeError, "starts must be a tuple or a list");
        return NULL;
    }
    PyObject *several = PyList_New(0), *send = PyList_New(0);
    int any_held = PyDict_GET_SIZE(held) > 0;
    /* at most one held row an output: written after the pass (make_held_row) */
    HeldRow *held_rows = any_held ? PyMem_New(HeldRow, PyList_GET_SIZE(outputs) + 1) : NULL;
    Py_ssize_t num_held_rows = 0;
    if (several == NULL || send == NULL || (any_held && held_rows == NULL))
        goto fail;
    /* outputs may not change size while this runs: nothing here calls back into Python code
       that could reach it, but index it by its size at each step all the same. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs); i++) {
        PyObject *output = PyList_GET_ITEM(outputs, i);
        Py_INCREF(output);
        PyObject *new_token_ids = slot_field(&output_fields, output, NEW_TOKEN_IDS);
        Py_ssize_t num_new = -1;
        if (new_token_ids != NULL) {
            num_new = PyObject_Length(new_token_ids);
            Py_DECREF(new_token_ids);
        }
        int failed = num_new < 0;
        if (num_new == 1) {
            failed = hand_out_one(output, index, held, starts, ends, blob, flush, send,
                                  held_rows + num_held_rows, &num_held_rows) < 0;
        } else if (num_new > 1) {
            failed = PyList_Append(several, output) < 0;
        } else if (num_new == 0 && any_held) {
            int finished = has_finished(output); /* a finish without a token */
            failed = finished < 0 || (finished && PyList_Append(send, output) < 0);
        }
        Py_DECREF(output);
        if (failed)
            goto fail;
    }
    write_held_rows(held_rows, num_held_rows);
    PyMem_Free(held_rows);
    PyObject *result = PyTuple_Pack(2, several, send);
    Py_DECREF(several);
    Py_DECREF(send);
    return result;
fail: /* the rows before the failing output are held, as their HeldRows say */
    write_held_rows(held_rows, num_held_rows);
    PyMem_Free(held_rows);
    Py_XDECREF(several);
    Py_XDECREF(send);
    if (!PyErr_Occurred())
        PyErr_NoMemory();
    return NULL;
}

static PyMethodDef methods[] = {
    {"hand_out_rows", hand_out_rows, METH_VARARGS, hand_out_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hand_out_native",
    "The scheduler's row hand-out in C (see _hand_out_native.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__hand_out_native(void)
{
    static const char *const output_field_names[] = {"new_token_ids", "request_id",
                                                     "finish_reason", NULL};
    if (slot_fields_init(&output_fields, output_field_names) < 0
        || (str_sampling_mask = PyUnicode_InternFromString("sampling_mask")) == NULL
        || PyType_Ready(&HeldRowsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "HeldRows", (PyObject *)&HeldRowsType) < 0)
        Py_CLEAR(m);
    return m;
}
