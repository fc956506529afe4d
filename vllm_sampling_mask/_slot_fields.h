/* Reading an object's fields at their slot offsets, for the per-output C loops
 * (core/_hand_out_native.c, engine/_take_rows_native.c).
 *
 * msgspec keeps a Struct's fields (vLLM's EngineCoreOutput) in object slots, as Python keeps a
 * class's __slots__ (RequestMaskRows): member descriptors of type T_OBJECT_EX. A loop reads each
 * field at its offset, as the descriptor itself reads it, instead of through PyObject_GetAttr's
 * lookup and descriptor call: several reads an output, much of a loop's work per output. The
 * offsets are found once per type; a type whose fields are not all object slots, or that
 * overrides attribute lookup, is read through PyObject_GetAttr.
 */
#ifndef VLLM_SAMPLING_MASK_SLOT_FIELDS_H
#define VLLM_SAMPLING_MASK_SLOT_FIELDS_H

#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX */

#define SLOT_FIELDS_MAX 4

/* The fields a loop reads of one kind of object (its outputs, its row lists). */
typedef struct {
    int num_fields;
    PyObject *names[SLOT_FIELDS_MAX]; /* interned by slot_fields_init */
    PyTypeObject *type;               /* the last type read (strong reference), or NULL */
    int direct;                       /* 1: type's fields are read at offset[] */
    Py_ssize_t offset[SLOT_FIELDS_MAX];
} SlotFields;

/* fields->names from a NULL-terminated list of field names: 0, or -1 with an exception set. */
static int
slot_fields_init(SlotFields *fields, const char *const *names)
{
    fields->num_fields = 0;
    fields->type = NULL;
    for (; *names != NULL; names++) {
        if (fields->num_fields == SLOT_FIELDS_MAX) {
            PyErr_SetString(PyExc_SystemError, "more fields than SLOT_FIELDS_MAX");
            return -1;
        }
        if ((fields->names[fields->num_fields++] = PyUnicode_InternFromString(*names)) == NULL)
            return -1;
    }
    return 0;
}

/* The offset of name's object slot in type, or -1 where it has none (no exception left set). */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name)
{
    PyObject *descr = PyObject_GetAttr((PyObject *)type, name);
    if (descr == NULL) {
        PyErr_Clear(); /* read through PyObject_GetAttr then, which raises where it should */
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX)
            offset = member->offset;
    }
    Py_DECREF(descr);
    return offset;
}

/* obj.<fields->names[which]> (a new reference, or NULL with an exception set). */
static PyObject *
slot_field(SlotFields *fields, PyObject *obj, int which)
{
    PyTypeObject *type = Py_TYPE(obj);
    if (type != fields->type) {
        Py_INCREF(type);
        Py_XSETREF(fields->type, type);
        fields->direct = type->tp_getattro == PyObject_GenericGetAttr;
        for (int i = 0; i < fields->num_fields; i++)
            fields->direct &= (fields->offset[i] = slot_offset(type, fields->names[i])) >= 0;
    }
    if (!fields->direct)
        return PyObject_GetAttr(obj, fields->names[which]);
    PyObject *value = *(PyObject **)((char *)obj + fields->offset[which]);
    if (value == NULL) { /* an unset slot, as its descriptor reports it */
        PyErr_SetObject(PyExc_AttributeError, fields->names[which]);
        return NULL;
    }
    return Py_NewRef(value);
}

#endif
